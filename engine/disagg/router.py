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
import queue
import threading
from dataclasses import replace
from multiprocessing.connection import (
    Connection,
    Listener,
    wait,
)
from pathlib import Path
from typing import cast

from engine.config import EngineConfig
from engine.core.adapters import AdapterReply
from engine.core.engine_core import CoreMessage, CoreUpdate
from engine.core.process import CoreFailed, CoreReady
from engine.disagg.fleet import (
    WorkerEnd,
    admit_remote,
    free_port,
    merge_gauges,
    plan_workers,
    remote_ranks,
)
from engine.disagg.partition import linear_tokens, partition
from engine.disagg.worker import DECODE, PREFILL
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


class DisaggregatedCore:
    """Prefill and decode workers behind one core interface; wait_ready() before use."""

    def __init__(self, config: EngineConfig) -> None:
        plan = config.disaggregation
        assert plan is not None, "DisaggregatedCore serves a disaggregated configuration"
        self.config = config
        # KV-Runahead: prompts of this many tokens or more are shared by the prefill workers
        self._threshold = plan.cooperative_prefill_threshold
        self._linear_tokens = plan.partition_linear_tokens or linear_tokens(
            read_json_object(Path(config.model) / "config.json"))
        self._plan = plan
        self._args = plan_workers(config, plan.kv_port or free_port(plan.kv_ip))
        remote = remote_ranks(plan)
        # No authkey here: admit_remote() runs the handshake with a deadline.
        self._listener = Listener((plan.kv_ip, plan.worker_port)) if remote else None
        context = multiprocessing.get_context("spawn")
        self.workers = [WorkerEnd.spawn(context, args) for args in self._args
                        if args.rank not in remote]
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
        self._coop_ids = 0
        self._sharing: set[str] = set()  # shared prompts before their first token

    # --- start-up ---

    def wait_ready(self) -> None:
        """Block until every worker (remote ones too) has loaded its model; raises if one
        could not."""
        self._accept_remote()  # (self.workers[rank] from here on)
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
        if self._listener is None:
            return
        remote = [args for args in self._args if args.rank in remote_ranks(self._plan)]
        self.workers += admit_remote(self._listener, remote, self._plan.worker_key)
        self.workers.sort(key=lambda w: w.rank)

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

    def _of(self, role: str) -> list[WorkerEnd]:
        return [w for w in self.workers if w.role == role]

    def _least_busy(self, role: str) -> WorkerEnd | None:
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

    def _share(self, rid: str, request: GenerationRequest, workers: list[WorkerEnd],
               decode: WorkerEnd) -> None:
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

    def _read(self, worker: WorkerEnd) -> None:
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

    def _passes(self, worker: WorkerEnd, out: StepOutput) -> bool:
        """Whether a worker's output goes to the front (not for requests ended here)."""
        rid = out.request_id
        if self._where.get(rid) != worker.rank:
            return False
        self._coming_from.pop(rid, None)
        self._sharing.discard(rid)  # its first token: a hand-off follows, or its end
        if out.finish_reason is not None:
            self._finish(rid)
        return True

    def _gone(self, worker: WorkerEnd) -> None:
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
