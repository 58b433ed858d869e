"""The router's workers (engine/disagg/router.py): where each runs, the processes it spawns,
the remote ones it admits, and its end of each one's messages."""

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
)

from engine.config import Disaggregation, EngineConfig
from engine.core.process import send_message
from engine.disagg.worker import DECODE, PREFILL, WorkerArgs, worker_main
from engine.outputs import Gauges

logger = logging.getLogger(__name__)

HANDSHAKE_SECONDS = 10.0  # a remote worker proves the key within this, or is dropped
_CLOSED = object()  # a worker's outbox: nothing more to write


def plan_workers(config: EngineConfig, port: int) -> list[WorkerArgs]:
    """Every rank's arguments: prefill workers first; this host's share its cores (or GPUs),
    the remote ones get theirs where they run."""
    plan = config.disaggregation
    assert plan is not None
    level = logging.getLogger().getEffectiveLevel()
    remote = remote_ranks(plan)
    roles = [PREFILL] * plan.num_prefill_workers + [DECODE] * plan.num_decode_workers
    ranks = [WorkerArgs(config, role, rank, plan.num_workers, plan.kv_ip, port, (), level,
                        remote_present=bool(remote)) for rank, role in enumerate(roles)]
    local = [args for args in ranks if args.rank not in remote]
    cores = share_cores(len(local)) if config.device != "cuda" else [()] * len(local)
    for slot, (args, share) in enumerate(zip(local, cores, strict=True)):
        ranks[args.rank] = replace(args, cores=share, local_slot=slot,
                                   local_workers=len(local))
    return ranks


def admit_remote(listener: Listener, ranks: list[WorkerArgs], key: bytes) -> list[WorkerEnd]:
    """The workers of other hosts, given the remote ranks in order as they connect (a peer
    that does not prove the key is dropped; the router waits for the right ones)."""
    ends = []
    for args in ranks:
        logger.info("waiting for remote %s worker %d at port %d", args.role, args.rank,
                    listener.address[1])
        while (conn := authenticated(listener.accept(), key)) is None:
            logger.warning("a connection to the worker port did not prove the key within "
                           "%.0f s; dropped", HANDSHAKE_SECONDS)
        send_message(conn, replace(args, router_clock=time.monotonic()))
        ends.append(WorkerEnd(args.rank, args.role, conn, conn))
    listener.close()
    return ends


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


def authenticated(conn: Connection, key: bytes) -> Connection | None:
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


class WorkerEnd:
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
    def spawn(cls, context, args: WorkerArgs) -> WorkerEnd:
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
