"""The engine core in a process of its own: its GIL serves the model alone.

The serving process keeps HTTP, tokenization and detokenization; the core process (spawned, so
CUDA initialises only there) loads the model and runs EngineCore. Messages cross two pipes as
pickles, one inbox message per request or abort and one CoreUpdate per step (the whole batch's
token ids at once), the way vLLM's V1 engine core and TGI's router/shard split do."""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import select
import signal
import socket
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection
from typing import TYPE_CHECKING

from engine.config import EngineConfig, is_config_error
from engine.core.adapters import AdapterList, adapter_list
from engine.core.engine_core import CoreMessage, CoreUpdate, EngineCore, prepare_to_serve
from engine.inputs import RequestLimits, StopCore
from engine.outputs import Gauges

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

_LOG_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"


@dataclass(frozen=True)
class CoreReady:
    """The core loaded its model: what the serving side needs to validate and report."""

    limits: RequestLimits
    gauges: Gauges
    adapters: AdapterList = ()  # registered now (lora_modules, or calls of other fronts)
    lora_enabled: bool = False
    # its model trades K/V between layers (cooperative prefill, engine/disagg/runahead.py);
    # LongRoPE models do not share prompts (slices would rotate differently)
    shares_prompts: bool = False

    @classmethod
    def of(cls, engine: LLMEngine) -> CoreReady:
        shares = (getattr(engine.runner.model, "exchanges_kv", False)
                  and engine.scheduler.long_rope_after is None)
        return cls(engine.limits, engine.gauges(), adapter_list(engine),
                   engine.config.enable_lora, shares)


@dataclass(frozen=True)
class FrontReading:
    """A front of a shared core reads its updates from now on (until then none are sent: a
    front still loading its tokenizer would fill the socket and block the core's sends)."""


@dataclass(frozen=True)
class CoreFailed:
    """The core could not load (the traceback is in the core's log; a configuration error
    has none: the front logs its one line)."""

    message: str
    config_error: bool = False

    @classmethod
    def of(cls, err: Exception) -> CoreFailed:
        """`err` logged here with its traceback, unless it is a configuration error."""
        if is_config_error(err):
            return cls(str(err), config_error=True)
        logger.exception("engine core: model loading failed")
        return cls(f"{type(err).__name__}: {err}")


def send_message(conn: Connection, message: object) -> None:
    """Connection.send without its ForkingPickler, which copies copyreg's dispatch table for
    every message (4x the pickling itself, and the core publishes every step): no message
    between a core and its fronts carries a handle that needs its reducers. recv() reads it."""
    conn.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))


class Readiness:
    """Which of some connections can be read without waiting (a message, or their end): one
    poll object kept, where Connection.poll and multiprocessing's wait() build a selector per
    call (~2.4 us each; the core asks after every step, the output thread after every update)."""

    def __init__(self, *conns: Connection) -> None:
        self._poll = select.poll()
        self._conns: dict[int, Connection] = {}
        for conn in conns:
            self.add(conn)

    def add(self, conn: Connection) -> None:
        self._poll.register(conn.fileno(), select.POLLIN)
        self._conns[conn.fileno()] = conn

    def remove(self, conn: Connection) -> None:
        """Before the connection closes (its descriptor number may be reused)."""
        self._poll.unregister(conn.fileno())
        del self._conns[conn.fileno()]

    def ready(self, timeout: float = 0.0) -> list[Connection]:
        """Those readable within `timeout` seconds (0: now)."""
        return [self._conns[fd] for fd, _ in self._poll.poll(timeout * 1000)]


class _CoreEnd(ABC):
    """What a serving process holds of a core in another process: one connection that request
    threads send on concurrently, and the core's greeting once it has loaded the model."""

    def __init__(self, inbox: Connection, updates: Connection) -> None:
        self._inbox = inbox
        self._updates = updates  # what receive() reads
        self._updates_ready = Readiness(updates)
        self._send_lock = threading.Lock()

    def send(self, message: CoreMessage | FrontReading) -> None:
        with self._send_lock:
            try:
                send_message(self._inbox, message)
            except OSError:  # the core is gone; receive() reports it
                pass

    def wait_ready(self) -> None:
        """Block until the core has loaded its model; raises RuntimeError if it could not."""
        first = self.receive()
        if not isinstance(first, CoreReady):
            if isinstance(first, CoreFailed) and first.config_error:
                raise ValueError(first.message)  # "invalid <key>=...": one line says it all
            reason = first.message if isinstance(first, CoreFailed) else self._why_gone()
            raise RuntimeError(f"the engine core process did not start: {reason}")
        self.limits, self.initial_gauges = first.limits, first.gauges
        self.initial_adapters, self.lora_enabled = first.adapters, first.lora_enabled

    @abstractmethod
    def receive(self) -> CoreUpdate | CoreReady | CoreFailed | None:
        """The core's next word; None once it is gone."""

    def has_update(self) -> bool:
        """Whether receive() would return without waiting (an end counts: it reads as None)."""
        return bool(self._updates_ready.ready())

    def _why_gone(self) -> str:
        return "it exited"


class ProcessCore(_CoreEnd):
    """Spawns the core process, which loads the model meanwhile; wait_ready() before use."""

    def __init__(self, config: EngineConfig) -> None:
        context = multiprocessing.get_context("spawn")
        inbox_end, inbox = context.Pipe(duplex=False)
        updates, outbox_end = context.Pipe(duplex=False)
        super().__init__(inbox, updates)
        self._process = context.Process(
            target=_core_main, name="engine-core", daemon=True,
            args=(config, inbox_end, outbox_end, logging.getLogger().getEffectiveLevel()))
        self._process.start()
        inbox_end.close()  # only the child holds these now: its death reads as EOF here
        outbox_end.close()

    def _why_gone(self) -> str:
        self.join(5)
        return f"it exited with code {self._process.exitcode}"

    def start(self) -> None:
        """The core steps as soon as it is ready; nothing to do."""

    def receive(self) -> CoreUpdate | CoreReady | CoreFailed | None:
        try:
            return self._updates.recv()
        except (EOFError, OSError):
            return None

    def is_alive(self) -> bool:
        return self._process.is_alive()

    def terminate(self) -> None:
        """Stop the core now (e.g. the serving side failed while it was loading)."""
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(2)

    def join(self, timeout: float) -> bool:
        self._process.join(timeout)
        if self._process.is_alive():
            logger.warning("engine core process did not stop within %.0f s; terminating", timeout)
            self._process.terminate()
            self._process.join(2)
            return False
        return True


class RemoteCore(_CoreEnd):
    """A core process that serves several fronts (engine/core/server.py), seen from one."""

    def __init__(self, path: str, authkey: bytes) -> None:
        self._conn = Client(path, "AF_UNIX", authkey=authkey)  # duplex: sends and updates
        super().__init__(self._conn, self._conn)
        self._gone = threading.Event()  # the core closed our connection

    def start(self) -> None:
        """The output thread reads from now on: the core may send."""
        self.send(FrontReading())

    def receive(self) -> CoreUpdate | CoreReady | CoreFailed | None:
        try:
            update = self._conn.recv()
        except (EOFError, OSError):
            update = None
        if update is None:  # its last word, or its death
            self._gone.set()
        return update

    def is_alive(self) -> bool:
        return not self._gone.is_set()

    def join(self, timeout: float) -> bool:
        """After StopCore: wait until the core has said its last (our receive() saw it end)."""
        return self._gone.wait(timeout)

    def terminate(self) -> None:
        """Drop the connection (the core aborts what we had running). A shutdown, not a close:
        it wakes a receive() blocked on another thread with an end of file."""
        with socket.socket(fileno=os.dup(self._conn.fileno())) as sock:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _Pipes:
    """The child's ends; a vanished front reads as StopCore, and sends to it are dropped."""

    def __init__(self, inbox: Connection, outbox: Connection) -> None:
        self._inbox, self._outbox = inbox, outbox
        self._inbox_ready = Readiness(inbox)
        self._front_gone = False

    def _has_message(self, timeout: float) -> bool:
        return bool(self._inbox_ready.ready(timeout))

    def receive(self, timeout: float | None) -> list[CoreMessage]:
        if self._front_gone:
            return [StopCore()]
        messages: list[CoreMessage] = []
        try:
            if timeout is not None and not self._has_message(timeout):
                return messages
            while self._has_message(0):
                messages.append(self._inbox.recv())
        except (EOFError, OSError):
            self._front_gone = True
            messages.append(StopCore())
        return messages

    def publish(self, update: CoreUpdate | CoreReady | CoreFailed | None) -> None:
        if self._front_gone:
            return
        try:
            send_message(self._outbox, update)
        except OSError:
            self._front_gone = True


def _core_main(config: EngineConfig, inbox: Connection, outbox: Connection,
               log_level: int) -> None:
    logging.basicConfig(level=log_level, format=_LOG_FORMAT)
    for signum in (signal.SIGINT, signal.SIGTERM):  # the front stops us, after its grace period
        signal.signal(signum, signal.SIG_IGN)
    pipes = _Pipes(inbox, outbox)
    from engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine.from_config(config)
    except Exception as err:
        pipes.publish(CoreFailed.of(err))
        return
    prepare_to_serve(engine)
    pipes.publish(CoreReady.of(engine))
    EngineCore(engine, pipes.receive, pipes.publish).run()
