"""DisaggregatedCore: what the serving side holds of disaggregated workers (DistServe).

It looks like one engine core to EngineLoop (send, receive, has_update, is_alive, join), and
routes: a request goes to the least busy prefill worker, naming the decode worker its KV will
go to (chosen then, as SGLang pairs them); the prefill worker's hand-off becomes that decode
worker's AddPrefilled notice, in the order the prefill worker published them (its KV follows
on the wire in that order). Every worker's updates merge into one stream. A worker that dies
fails its requests (and those on their way from or to it) and turns the core unhealthy, so
/ping says 503; nothing waits for it."""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.process
import os
import queue
import socket
import threading
import time
from dataclasses import replace
from multiprocessing import AuthenticationError
from multiprocessing.connection import (
    Connection,
    Listener,
    answer_challenge,
    deliver_challenge,
    wait,
)
from pathlib import Path
from typing import cast

from engine.config import Disaggregation, EngineConfig
from engine.core.adapters import AdapterReply
from engine.core.engine_core import CoreMessage, CoreUpdate
from engine.core.process import CoreFailed, CoreReady, send_message
from engine.disagg.partition import linear_tokens, partition
from engine.disagg.worker import DECODE, PREFILL, WorkerArgs, worker_main
from engine.inputs import (
    AbortRequest,
    AddAdapter,
    AddPrefilled,
    AddRequest,
    CooperativeSlice,
    GenerationRequest,
    PrefillRequest,
    RemoveAdapter,
    RequestLimits,
    StopCore,
)
from engine.model_files import read_json_object
from engine.outputs import Gauges, Handoff
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason
from engine.text.output_processor import StepOutput

logger = logging.getLogger(__name__)

SLICE_PARAMS = SamplingParams(max_new_tokens=1)  # a passed-on slice's one token is dropped
HANDSHAKE_SECONDS = 10.0  # a remote worker proves the key within this, or is dropped
_CLOSED = object()  # a worker's outbox: nothing more to write


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def share_cores(num_workers: int) -> list[tuple[int, ...]]:
    """This host's cores cut into one contiguous share per worker (shared round-robin when
    there are fewer cores than workers)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < num_workers:
        return [(cores[i % len(cores)],) for i in range(num_workers)]
    size, extra = divmod(len(cores), num_workers)
    shares, start = [], 0
    for i in range(num_workers):
        end = start + size + (1 if i < extra else 0)
        shares.append(tuple(cores[start:end]))
        start = end
    return shares


def _authenticated(conn: Connection, key: bytes) -> Connection | None:
    """`conn` once its peer proved `key` (multiprocessing's HMAC handshake, both ways), None
    (closed) if it did not within HANDSHAKE_SECONDS: a silent or wrong peer never stalls the
    router's start."""
    proved = threading.Event()

    def handshake() -> None:
        try:
            deliver_challenge(conn, key)
            answer_challenge(conn, key)
            proved.set()
        except (AuthenticationError, EOFError, OSError):
            pass

    thread = threading.Thread(target=handshake, daemon=True)
    thread.start()
    thread.join(HANDSHAKE_SECONDS)
    if proved.is_set():
        return conn
    conn.close()  # (ends a handshake still waiting)
    return None


def remote_ranks(plan: Disaggregation | None) -> set[int]:
    """The ranks that join from other hosts: the last of each side's."""
    if plan is None:
        return set()
    prefill = range(plan.num_prefill_workers - plan.remote_prefill_workers,
                    plan.num_prefill_workers)
    decode = range(plan.num_workers - plan.remote_decode_workers, plan.num_workers)
    return {*prefill, *decode}


def merge_gauges(gauges: list[Gauges]) -> Gauges:
    """The workers' gauges as one engine's: counts and blocks summed."""
    first = gauges[0]
    hit_rates = [g.prefix_cache_hit_rate for g in gauges]
    return first._replace(
        num_waiting=sum(g.num_waiting for g in gauges),
        num_running=sum(g.num_running for g in gauges),
        kv_blocks_used=sum(g.kv_blocks_used for g in gauges),
        kv_blocks_total=sum(g.kv_blocks_total for g in gauges),
        max_concurrency=sum(g.max_concurrency for g in gauges),
        prefix_cache_hit_rate=sum(hit_rates) / len(hit_rates),
        busy_step_seconds=sum(g.busy_step_seconds for g in gauges),
        busy_sequence_steps=sum(g.busy_sequence_steps for g in gauges))


class _Worker:
    """One worker and the router's ends of its pipes: a process of this host, or a connection
    from another host's `batchyard worker` (process None)."""

    def __init__(self, rank: int, role: str, inbox: Connection, updates: Connection,
                 process: multiprocessing.process.BaseProcess | None = None) -> None:
        self.rank, self.role = rank, role
        self.inbox, self.updates, self.process = inbox, updates, process
        # Messages go out on a thread of their own: a worker busy with a long step lets its
        # pipe fill, and the router (holding its lock) must never wait for that.
        self._outbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        threading.Thread(target=self._write_all, name=f"to-{role}-{rank}", daemon=True).start()
        self.in_flight = 0  # requests it holds (a load-balancing hint)
        self.gauges: Gauges | None = None
        self.alive = True

    @classmethod
    def spawn(cls, context, args: WorkerArgs) -> _Worker:
        inbox_end, inbox = context.Pipe(duplex=False)
        updates, outbox_end = context.Pipe(duplex=False)
        process = context.Process(target=worker_main, args=(args, inbox_end, outbox_end),
                                  name=f"{args.role}-worker-{args.rank}", daemon=True)
        process.start()
        inbox_end.close()  # only the child holds these now: its death reads as EOF here
        outbox_end.close()
        return cls(args.rank, args.role, inbox, updates, process)

    def stop(self, timeout: float) -> None:
        """After its last word: wait for its process (terminated past `timeout`)."""
        self._outbox.put(_CLOSED)
        if self.process is None:
            self.inbox.close()
            return
        self.process.join(timeout)
        if self.process.is_alive():  # (workers ignore SIGTERM: the router stops them)
            logger.warning("%s worker %d did not stop within %.0f s; killing it", self.role,
                           self.rank, timeout)
            self.process.kill()
            self.process.join(2)

    def send(self, message: object) -> None:
        """Queue `message` for the worker, in order."""
        self._outbox.put(message)

    def _write_all(self) -> None:
        while (message := self._outbox.get()) is not _CLOSED:
            try:
                send_message(self.inbox, message)
            except OSError:  # it is gone; its reader reports it
                return

    def receive(self) -> object | None:
        try:
            return self.updates.recv()
        except (EOFError, OSError):
            return None


class DisaggregatedCore:
    """Prefill and decode workers behind one core interface; wait_ready() before use."""

    def __init__(self, config: EngineConfig) -> None:
        plan = config.disaggregation
        assert plan is not None, "DisaggregatedCore serves a disaggregated configuration"
        self.config = config
        context = multiprocessing.get_context("spawn")
        port = plan.kv_port or free_port(plan.kv_ip)
        level = logging.getLogger().getEffectiveLevel()
        roles = [PREFILL] * plan.num_prefill_workers + [DECODE] * plan.num_decode_workers
        self._args = [WorkerArgs(config, role, rank, plan.num_workers, plan.kv_ip, port, (),
                                 level) for rank, role in enumerate(roles)]
        remote = remote_ranks(plan)
        self._args = [replace(args, remote_present=bool(remote)) for args in self._args]
        local = [replace(args, local_slot=slot, local_workers=plan.num_workers - len(remote))
                 for slot, args in enumerate(a for a in self._args if a.rank not in remote)]
        if config.device != "cuda":  # this host's cores, shared out among its workers
            local = [replace(args, cores=cores)
                     for args, cores in zip(local, share_cores(len(local)), strict=True)]
        self._plan = plan
        # No authkey here: _authenticated() runs the handshake with a deadline.
        self._listener = Listener((plan.kv_ip, plan.worker_port)) if remote else None
        self._workers: list[_Worker | None] = [None] * plan.num_workers
        for args in local:
            self._workers[args.rank] = _Worker.spawn(context, args)
        self._updates: queue.SimpleQueue[CoreUpdate | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._requests: dict[str, GenerationRequest] = {}  # unfinished, by id
        self._where: dict[str, int] = {}  # request id -> the worker that holds it
        self._coming_from: dict[str, int] = {}  # handed off, no decode output yet: its sender
        self._aborted: dict[str, AbortRequest] = {}  # asked to end, not ended yet
        self._ended = 0  # workers whose last word came
        self._failed: str | None = None  # why the workers no longer serve
        self._stopping = False  # StopCore sent: workers ending is no failure
        self._readers: list[threading.Thread] = []
        # KV-Runahead: prompts of this many tokens or more are shared by the prefill workers
        self._threshold = plan.cooperative_prefill_threshold
        self._linear_tokens = plan.partition_linear_tokens or linear_tokens(
            read_json_object(Path(config.model) / "config.json"))
        self._coop_ids = 0
        self._sharing: set[str] = set()  # shared prompts before their first token

    # --- start-up ---

    def wait_ready(self) -> None:
        """Block until every worker (remote ones too) has loaded its model; raises if one
        could not."""
        self._accept_remote()
        readies = []
        pending = {worker.updates: worker for worker in self.workers}
        while pending:  # whichever speaks first: one that fails stops the others' wait
            for conn in wait(list(pending)):
                worker = pending.pop(cast(Connection, conn))
                first = worker.receive()
                if not isinstance(first, CoreReady):
                    self.terminate()
                    if isinstance(first, CoreFailed) and first.config_error:
                        raise ValueError(first.message)
                    reason = first.message if isinstance(first, CoreFailed) else "it exited"
                    raise RuntimeError(f"disaggregated {worker.role} worker {worker.rank} did "
                                       f"not start: {reason}")
                worker.gauges = first.gauges
                readies.append(first)
        self.limits = RequestLimits(
            min(r.limits.max_model_len for r in readies),
            min(r.limits.max_seq_tokens for r in readies), readies[0].limits.vocab_size)
        if self._threshold and len(self._of(PREFILL)) > 1 and not all(
                r.shares_prompts for r in readies):
            logger.warning("cooperative prefill is off: this model does not trade K/V between "
                           "layers (the transformers fallback, or LongRoPE)")
            self._threshold = None
        self.initial_gauges = merge_gauges([r.gauges for r in readies])
        self.initial_adapters: tuple = ()
        self.lora_enabled = False
        logger.info("disaggregated serving: %d prefill and %d decode workers ready",
                    len(self._of(PREFILL)), len(self._of(DECODE)))

    def _accept_remote(self) -> None:
        """Workers of other hosts, in rank order as they connect (a wrong key is logged and
        refused; the router waits for the right ones)."""
        if self._listener is None:
            return
        for rank in sorted(remote_ranks(self.config.disaggregation)):
            args = self._args[rank]
            logger.info("waiting for remote %s worker %d at port %d", args.role, rank,
                        self._listener.address[1])
            while (conn := _authenticated(self._listener.accept(), self._plan.worker_key)) \
                    is None:
                logger.warning("a connection to the worker port did not prove the key within "
                               "%.0f s; dropped", HANDSHAKE_SECONDS)
            send_message(conn, replace(args, router_clock=time.monotonic()))
            self._workers[rank] = _Worker(rank, args.role, conn, conn)
        self._listener.close()

    @property
    def workers(self) -> list[_Worker]:
        return [w for w in self._workers if w is not None]

    def start(self) -> None:
        for worker in self.workers:
            thread = threading.Thread(target=self._read, args=(worker,), daemon=True,
                                      name=f"router-{worker.role}-{worker.rank}")
            thread.start()
            self._readers.append(thread)

    # --- the core interface ---

    def send(self, message: CoreMessage) -> None:
        with self._lock:
            if isinstance(message, AddRequest):
                self._add(message)
            elif isinstance(message, AbortRequest):
                self._abort(message)
            elif isinstance(message, (AddAdapter, RemoveAdapter)):
                self._updates.put(CoreUpdate([], self._gauges(), replies=(AdapterReply(
                    message.call_id, "ValueError",
                    "LoRA adapters are not served with disaggregated prefill/decode"),)))
            elif isinstance(message, StopCore):
                self._stopping = True
                for worker in self.workers:
                    worker.send(message)

    def receive(self) -> CoreUpdate | None:
        return self._updates.get()

    def has_update(self) -> bool:
        return not self._updates.empty()

    def is_alive(self) -> bool:
        return self._failed is None and self._ended == 0

    def join(self, timeout: float) -> bool:
        for worker in self.workers:
            worker.stop(timeout)
        return True

    def terminate(self) -> None:
        if self._listener is not None:
            self._listener.close()
        for worker in self.workers:
            worker.stop(0)

    # --- routing (under the lock) ---

    def _of(self, role: str) -> list[_Worker]:
        return [w for w in self.workers if w.role == role]

    def _least_busy(self, role: str) -> _Worker | None:
        live = [w for w in self._of(role) if w.alive]
        return min(live, key=lambda w: w.in_flight) if live else None

    def _add(self, message: AddRequest) -> None:
        rid, request = message.request_id, message.request
        prefill, decode = self._least_busy(PREFILL), self._least_busy(DECODE)
        if self._failed is not None or prefill is None or decode is None:
            self._updates.put(CoreUpdate([self._ending(rid, request, FinishReason.ERROR,
                                                       self._failed or "no worker left")],
                                         self._gauges()))
            return
        self._requests[rid] = request
        sharing = [w for w in self._of(PREFILL) if w.alive]
        long_prompt = self._threshold and len(request.prompt_token_ids) >= self._threshold
        if len(sharing) > 1 and long_prompt:
            self._share(rid, request, sharing, decode)
            return
        self._where[rid] = prefill.rank
        prefill.in_flight += 1
        prefill.send(PrefillRequest(rid, request, decode_rank=decode.rank))

    def _share(self, rid: str, request: GenerationRequest, workers: list[_Worker],
               decode: _Worker) -> None:
        """KV-Runahead: a slice of the prompt per prefill worker, the last one's the request
        itself (the others' outputs are theirs alone: dropped here). Aborts wait for its first
        token: each slice's step needs its neighbours' (engine/disagg/runahead.py)."""
        prompt = request.prompt_token_ids
        starts = partition(len(prompt), len(workers), self._linear_tokens)
        self._coop_ids += 1
        self._sharing.add(rid)
        for i, (worker, start) in enumerate(zip(workers, starts, strict=True)):
            last = i == len(workers) - 1
            end = len(prompt) if last else starts[i + 1]
            part = request if last else GenerationRequest(prompt[:end], SLICE_PARAMS)
            worker.send(CooperativeSlice(
                rid if last else f"{rid}#slice{i}", replace(part, deadline=None),
                decode_rank=decode.rank, coop_id=self._coop_ids, slice_start=start,
                prev_rank=workers[i - 1].rank if i else None,
                next_rank=None if last else workers[i + 1].rank))
        self._where[rid] = workers[-1].rank
        workers[-1].in_flight += 1

    def _abort(self, message: AbortRequest) -> None:
        rid = message.request_id
        where = self._where.get(rid)
        if where is None:
            return  # ended already
        self._aborted[rid] = message
        if rid in self._sharing:
            return  # its slices run together first (_hand_on ends it then)
        self.workers[where].send(message)
        if rid in self._coming_from:  # the decode worker may not hold it yet: end it here
            self._updates.put(CoreUpdate([self._end(rid, message)], self._gauges()))

    def _hand_on(self, handoff: Handoff) -> StepOutput | None:
        """Forward a prefill worker's hand-off to its decode worker; the ending of a request
        aborted meanwhile (its KV is on the wire: the decode worker reads and drops it)."""
        rid = handoff.request_id
        request = self._requests.get(rid)
        source, target = self.workers[handoff.src], self.workers[handoff.dst]
        if request is None:
            return None
        source.in_flight -= 1
        del self._where[rid]  # (ended below, or at its decode worker)
        if not target.alive:
            return self._ending(rid, request, FinishReason.ERROR, self._failed, tokens=1)
        target.send(AddPrefilled(rid, request, handoff.token_id, handoff.seed,
                                 handoff.num_kv_tokens, handoff.src))
        target.in_flight += 1
        self._where[rid] = target.rank
        self._coming_from[rid] = source.rank
        aborted = self._aborted.get(rid)
        if aborted is None:
            return None
        target.send(aborted)
        return self._end(rid, aborted)

    def _end(self, rid: str, abort: AbortRequest) -> StepOutput:
        return self._ending(rid, self._requests[rid], abort.reason, abort.error, tokens=1)

    def _ending(self, rid: str, request: GenerationRequest, reason: FinishReason,
                error: str | None, tokens: int = 0) -> StepOutput:
        self._finish(rid)
        return StepOutput(rid, None, None, len(request.prompt_token_ids), tokens,
                          reason.value, error)

    def _finish(self, rid: str) -> None:
        self._sharing.discard(rid)
        self._requests.pop(rid, None)
        self._aborted.pop(rid, None)
        self._coming_from.pop(rid, None)
        where = self._where.pop(rid, None)
        if where is not None:
            self.workers[where].in_flight -= 1

    def _gauges(self) -> Gauges:
        return merge_gauges([w.gauges for w in self.workers if w.gauges is not None])

    # --- each worker's updates ---

    def _read(self, worker: _Worker) -> None:
        while True:
            update = worker.receive()
            if not isinstance(update, CoreUpdate):
                self._gone(worker)
                return
            with self._lock:
                outputs = [out for out in update.outputs if self._passes(worker, out)]
                outputs += [out for h in update.handoffs if (out := self._hand_on(h))]
                worker.gauges = update.gauges
                merged = CoreUpdate(outputs, self._gauges(), update.stats)
            self._updates.put(merged)

    def _passes(self, worker: _Worker, out: StepOutput) -> bool:
        """Whether a worker's output goes to the front (not for requests ended here)."""
        rid = out.request_id
        if self._where.get(rid) != worker.rank:
            return False
        self._coming_from.pop(rid, None)
        self._sharing.discard(rid)  # its first token: a hand-off follows, or its end
        if out.finish_reason is not None:
            self._finish(rid)
        return True

    def _gone(self, worker: _Worker) -> None:
        """A worker's last word (or death): fail what it held or what moves from or to it."""
        with self._lock:
            worker.alive = False
            self._ended += 1
            doomed = [rid for rid, w in self._where.items() if w == worker.rank]
            doomed += [rid for rid, src in self._coming_from.items() if src == worker.rank
                       and rid not in doomed]
            if self._failed is None:
                self._failed = f"disaggregated {worker.role} worker {worker.rank} stopped"
                if not self._stopping:
                    logger.error("%s; /ping now answers 503", self._failed)
            for rid in doomed:
                w = self._where.get(rid)
                if w is not None and w != worker.rank:
                    self.workers[w].send(AbortRequest(rid, FinishReason.ERROR))
            outputs = [self._ending(rid, self._requests[rid], FinishReason.ERROR, self._failed)
                       for rid in doomed]
            last = self._ended == len(self.workers)
        self._updates.put(CoreUpdate(outputs, self._gauges()))
        if last:
            self._updates.put(None)
