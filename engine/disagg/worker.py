"""A disaggregated worker process: one engine on its own cores or GPU, prefill or decode.

Spawned by the router (engine/disagg/router.py) with two pipes, as the engine core process is
(engine/core/process.py): it joins the KV link, loads the model, says CoreReady, then runs the
EngineCore loop with its role (engine/disagg/roles.py). A decode worker's receiving threads
wake the loop through a pipe of its own when a hand-off's KV has arrived."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Client, Connection
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from engine.core.engine_core import CoreMessage, EngineCore, prepare_to_serve
from engine.core.process import CoreFailed, CoreReady, Readiness, _Pipes

if TYPE_CHECKING:  # torch and what needs it load in the worker's process only (the router
    import torch  # imports this module for WorkerArgs)

    from engine.disagg.roles import DecodeRole, PrefillRole

logger = logging.getLogger(__name__)

PREFILL, DECODE = "prefill", "decode"


@dataclass(frozen=True)
class WorkerArgs:
    """What the router tells worker `rank` (prefill workers first, then decode workers)."""

    config: EngineConfig
    role: str  # PREFILL or DECODE
    rank: int
    world_size: int
    kv_host: str
    kv_port: int
    cores: tuple[int, ...]  # CPU cores it runs on (the host's, shared out); () : all
    log_level: int
    # its place among the workers of its host (GPU number local_slot, modulo the cards)
    local_slot: int = 0
    local_workers: int = 1
    remote_present: bool = False  # some workers run on other hosts: KV staged through hosts
    # a remote worker's: the router's monotonic clock when it sent these (deadlines rebased)
    router_clock: float | None = None


class _WorkerPipes(_Pipes):
    """The core's pipes, plus a wake-up pipe the receiving threads write to and the arrivals
    they queued, read as messages."""

    def __init__(self, inbox: Connection, outbox: Connection) -> None:
        super().__init__(inbox, outbox)
        self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)
        self._either_ready = Readiness(inbox, self._wake_r)
        self.role: DecodeRole | None = None

    def wake(self) -> None:
        self._wake_w.send_bytes(b"")

    def receive(self, timeout: float | None) -> list[CoreMessage]:
        """The inbox's messages (waiting up to `timeout` for them or an arrival), then the
        arrivals the receiving threads queued."""
        if timeout is not None:
            self._either_ready.ready(timeout)
        while self._wake_r.poll():
            self._wake_r.recv_bytes()
        messages: list[Any] = super().receive(None)  # (and the role's arrivals, below)
        if self.role is not None:
            messages += self.role.take_arrivals()
        return messages


def worker_device(config: EngineConfig, args: WorkerArgs) -> tuple[torch.device, EngineConfig]:
    """Where this worker computes: its host's GPU number local_slot (modulo the cards there
    are) on CUDA, gpu_memory_utilization divided among that host's workers on the card."""
    import torch

    if config.device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu"), replace(config, device="cpu")
    cards = torch.cuda.device_count()
    gpu = args.local_slot % cards
    torch.cuda.set_device(gpu)
    sharing = max(1, len(range(gpu, args.local_workers, cards)))
    return torch.device("cuda", gpu), replace(
        config, device="cuda", gpu_memory_utilization=config.gpu_memory_utilization / sharing)


def buffer_device(config: EngineConfig, device: torch.device, args: WorkerArgs) -> torch.device:
    """Where KV is staged for the wire: the GPU (NCCL) when every worker of the host has a card
    of its own and no worker is elsewhere (every rank must take the same backend), else host
    memory (gloo; NCCL also refuses two ranks on one card). kv_buffer_device=cuda insists."""
    import torch

    choice = config.disaggregation.kv_buffer_device if config.disaggregation else "auto"
    if choice == "auto":
        own_cards = device.type == "cuda" and torch.cuda.device_count() >= args.local_workers
        choice = "cuda" if own_cards and not args.remote_present else "cpu"
    return device if choice == "cuda" and device.type == "cuda" else torch.device("cpu")


def serve_remote(router: tuple[str, int], key: bytes, model_dir: str | None,
                 gpu: int = 0) -> None:
    """A worker on another host (`batchyard worker`): join the router at `router`, take the
    rank and configuration it gives, load the model from `model_dir` (default: the router's
    path) onto GPU number `gpu` (on CUDA) and serve until the router goes."""
    conn = Client(router, authkey=key)  # duplex: messages in, updates out
    args: WorkerArgs = conn.recv()
    args = replace(args, local_slot=gpu, local_workers=1)
    if model_dir is not None:
        args = replace(args, config=replace(args.config, model=model_dir))
    logger.info("joined the router at %s:%d as %s worker %d", *router, args.role, args.rank)
    worker_main(args, conn, conn, stoppable=True)


def worker_main(args: WorkerArgs, inbox: Connection, outbox: Connection,
                stoppable: bool = False) -> None:
    """`stoppable`: signals stop it (a remote worker's own process); else the router does."""
    logging.basicConfig(level=args.log_level, format=(
        f"%(asctime)s %(levelname)s {args.role}-worker-{args.rank} %(name)s: %(message)s"))
    if not stoppable:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
    import torch

    from engine.disagg.roles import DecodeRole, PrefillRole
    from engine.disagg.transfer import KVLink

    if args.cores:
        os.sched_setaffinity(0, args.cores)
        torch.set_num_threads(len(args.cores))
    pipes = _WorkerPipes(inbox, outbox)
    config = args.config
    if args.role == PREFILL:  # it hands each prompt on after one token: nothing to overlap
        config = replace(config, async_scheduling=False, speculative_method=None,
                         speculative_model=None)
    device, config = worker_device(config, args)
    assert config.disaggregation is not None  # the router starts workers for it only
    from engine.llm_engine import LLMEngine

    try:
        link = KVLink(args.rank, args.world_size, args.kv_host, args.kv_port,
                      buffer_device(config, device, args),
                      config.disaggregation.transfer_timeout_s)
        engine = LLMEngine.from_config(config)
    except Exception as err:
        pipes.publish(CoreFailed.of(err))
        logging.shutdown()
        os._exit(1)  # (the same teardown as below, with a store perhaps up)
    role: PrefillRole | DecodeRole
    if args.role == PREFILL:
        role = PrefillRole(engine, link)
    else:
        role = pipes.role = DecodeRole(engine, link, pipes.wake)
    if args.router_clock is not None:  # deadlines are the router host's monotonic times
        role.clock_offset = time.monotonic() - args.router_clock
    prepare_to_serve(engine)
    pipes.publish(CoreReady.of(engine))
    try:
        EngineCore(engine, pipes.receive, pipes.publish, role).run()
    finally:
        role.close()
        link.close()
    # Done and said so: leave without the interpreter's teardown, in which rank 0's TCP store
    # server thread, still joinable, aborts the process ("terminate called ...", exit -6).
    logging.shutdown()
    os._exit(0)
