"""EngineCore: the loop that owns an LLMEngine and only schedules and computes.

It reads AddRequest / AbortRequest / StopCore messages from an inbox, expires deadlines, runs
engine.step_outputs() and publishes each step's token ids with the gauges and step facts as a
CoreUpdate. Text, stop strings and callers live on the other side (EngineLoop). The same loop
runs on a thread (ThreadCore) or in a process of its own (engine/core/process.py). A step far
slower than usual is logged with its phases, garbage collections and compiles (StepWatch)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from engine.core.adapters import AdapterList, AdapterReply, adapter_list, answer
from engine.heap import freeze_start_up_heap
from engine.inputs import AbortRequest, AddAdapter, AddRequest, RemoveAdapter, StopCore
from engine.llm_engine import LLMEngine
from engine.observe.step_watch import StepWatch
from engine.outputs import Gauges, Handoff, StepStats
from engine.runner.tp_workers import WorkerLost
from engine.sequence import FinishReason
from engine.text.output_processor import StepOutput

logger = logging.getLogger(__name__)

IDLE_POLL_SECONDS = 0.5  # how often an idle core re-checks its deadlines
MAX_CONSECUTIVE_FAILURES = 3  # then the core stops and /ping turns 503

CoreMessage = AddRequest | AbortRequest | AddAdapter | RemoveAdapter | StopCore


@dataclass(frozen=True)
class CoreUpdate:
    """One step's news from the core: token ids, the gauges after it, its facts for metrics;
    after adapter calls, their replies and the adapter list (None: unchanged)."""

    outputs: list[StepOutput]
    gauges: Gauges
    stats: StepStats | None = None
    replies: tuple[AdapterReply, ...] = ()
    adapters: AdapterList | None = None
    handoffs: tuple[Handoff, ...] = ()  # a disaggregated prefill worker's (engine/disagg/)

    def __reduce__(self):
        # To the serving process as columns of plain values: at batch 25 this pickles in ~17 us
        # instead of ~68 (an object per output) on the core's every step, and loads faster.
        columns = list(zip(*self.outputs, strict=True))
        stats = None if self.stats is None else tuple(self.stats)
        return _rebuild_update, (columns, tuple(self.gauges), stats, self.replies, self.adapters,
                                 self.handoffs)


class CoreRole(Protocol):
    """What a disaggregated worker adds to the loop (engine/disagg/roles.py)."""

    def apply(self, message: object, deadlines: dict[str, float]) -> bool:
        """Take a message of the role's own (True), recording deadlines it accepts."""

    def after_step(self, outputs: list[StepOutput]) -> tuple[Handoff, ...]:
        """What the step's outputs hand on to other workers."""

    def forget(self, request_id: str, held: bool) -> None:
        """A request ended by an abort or its deadline; `held`: this engine held it (else it
        may still be on its way here)."""


def prepare_to_serve(engine: LLMEngine) -> None:
    """What a core process finishes before it reports ready: the guided tokenizer's background
    build (its GIL would stall the first steps), compiled attention still valid (else compiled
    again now), then freezing the start-up heap."""
    from engine.runner.attention_check import refresh_warm_up  # torch: the core has loaded it

    engine.guided.wait_built()
    refresh_warm_up(engine.runner)
    freeze_start_up_heap()


def _rebuild_update(columns: list[tuple], gauges: tuple, stats: tuple | None,
                    replies: tuple[AdapterReply, ...] = (),
                    adapters: AdapterList | None = None,
                    handoffs: tuple[Handoff, ...] = ()) -> CoreUpdate:
    make = StepOutput._make
    return CoreUpdate([make(row) for row in zip(*columns, strict=True)], Gauges._make(gauges),
                      None if stats is None else StepStats._make(stats), replies, adapters,
                      handoffs)


class EngineCore:
    """schedule → run → postprocess in a loop; `receive(timeout)` returns the inbox's messages
    (waiting up to timeout when it is empty; None: no wait), `publish` sends an update, and None
    once after the last one."""

    def __init__(self, engine: LLMEngine,
                 receive: Callable[[float | None], list[CoreMessage]],
                 publish: Callable[[CoreUpdate | None], None],
                 role: CoreRole | None = None) -> None:
        self.engine = engine
        self.role = role  # a disaggregated worker's prefill or decode side
        self._receive = receive
        self._publish = publish
        self._deadlines: dict[str, float] = {}
        self._stopping = False
        self._failures = 0
        self._gauges_unsent = False  # requests queued or aborted since the last update
        self.watch = StepWatch()
        engine.measure_phases(self.watch.phases)

    def run(self) -> None:
        error = "the engine loop stopped"
        self.watch.install()
        try:
            timeout: float | None = None
            while not self._stopping:
                self._apply(self._receive(timeout))
                self._expire()
                self.engine.check_health()
                timeout = self._step_once()
        except WorkerLost as err:  # the ranks are out of step: no later step can be trusted
            logger.error("engine core stops: %s", err)
            error = f"the engine stopped: {err}"
        except Exception:
            logger.exception("engine core crashed")
        finally:
            self.watch.uninstall()
            try:
                self._end_all(error)
            finally:
                self.engine.close()

    def _step_once(self) -> float | None:
        """One step if there is work; returns how long the next receive may wait."""
        engine = self.engine
        if not engine.has_unfinished():
            self._send([], force=self._gauges_unsent)
            return IDLE_POLL_SECONDS
        self.watch.start()
        start = time.perf_counter()
        outputs = self._step()
        if engine.last_batch is None:  # nothing could run: wait for time or input
            self._send(outputs, force=self._gauges_unsent)
            hint = engine.scheduler.wait_hint()
            return IDLE_POLL_SECONDS if hint is None else max(hint, 1e-4)
        stats = engine.last_step_stats(time.perf_counter() - start)
        self.watch.finish(stats)
        handoffs = self.role.after_step(outputs) if self.role is not None else ()
        self._send(outputs, stats, handoffs=handoffs)
        return None

    def _step(self) -> list[StepOutput]:
        try:
            outputs = self.engine.step_outputs()
        except WorkerLost:
            raise
        except Exception:
            self._failures += 1
            if self._failures >= MAX_CONSECUTIVE_FAILURES:
                raise
            # The failed batch's KV is not trustworthy: fail its requests, keep serving the rest.
            logger.exception("engine step failed; failing the requests of that batch")
            return self.engine.fail_last_batch("engine failure")
        self._failures = 0
        return outputs

    def _apply(self, messages: list[CoreMessage]) -> None:
        outputs = []
        replies = []
        for message in messages:
            if self.role is not None and self.role.apply(message, self._deadlines):
                continue
            if isinstance(message, AddRequest):
                self.engine.add_validated(message.request_id, message.request)
                if message.request.deadline is not None:
                    self._deadlines[message.request_id] = message.request.deadline
            elif isinstance(message, AbortRequest):
                outputs += self._abort(message.request_id, message.reason, message.error)
            elif isinstance(message, (AddAdapter, RemoveAdapter)):
                replies.append(answer(self.engine, message))
            else:
                self._stopping = True
        if replies:  # at once, with the list: its caller returns once its front knows it
            self._send(outputs, replies=tuple(replies))
        elif outputs:
            self._send(outputs)
        elif messages and not self._stopping:  # the next update counts them: one per step
            self._gauges_unsent = True

    def _expire(self) -> None:
        if not self._deadlines:  # streams have none: nothing to read the clock for
            return
        now = time.monotonic()
        expired = [rid for rid, t in self._deadlines.items() if t <= now]
        self._send([out for rid in expired
                    for out in self._abort(rid, FinishReason.TIMEOUT, "predict_timeout exceeded")],
                   force=False)

    def _abort(self, request_id: str, reason: FinishReason,
               error: str | None) -> list[StepOutput]:
        output = self.engine.abort(request_id, reason, error)
        self._deadlines.pop(request_id, None)
        if self.role is not None:
            self.role.forget(request_id, held=output is not None)
        return [output] if output else []

    def _send(self, outputs: list[StepOutput], stats: StepStats | None = None,
              force: bool = True, replies: tuple[AdapterReply, ...] = (),
              handoffs: tuple[Handoff, ...] = ()) -> None:
        if not (outputs or stats or force):
            return
        if self._deadlines:
            for out in outputs:
                if out.finish_reason is not None:
                    self._deadlines.pop(out.request_id, None)
        self._gauges_unsent = False
        adapters = adapter_list(self.engine) if replies else None
        self._publish(CoreUpdate(outputs, self.engine.gauges(), stats, replies, adapters,
                                 handoffs))

    def _end_all(self, error: str) -> None:
        try:
            self._send([out for rid in self.engine.request_ids()
                        for out in self._abort(rid, FinishReason.ERROR, error)], force=False)
        finally:
            self._publish(None)


class ThreadCore:
    """EngineCore on a thread of this process; the inbox and outbox are in-memory queues."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.initial_gauges = engine.gauges()
        self.initial_adapters = adapter_list(engine)  # before the core thread starts
        self._inbox: queue.SimpleQueue[CoreMessage] = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[CoreUpdate | None] = queue.SimpleQueue()
        core = EngineCore(engine, self._take, self._outbox.put)
        self._thread = threading.Thread(target=core.run, name="engine-loop", daemon=True)

    def start(self) -> None:
        """As a core process before it is ready: compiled attention still valid (else compiled
        again now, not in a served step). The heap is not frozen: this process goes on."""
        from engine.runner.attention_check import refresh_warm_up  # torch: the engine has loaded it

        refresh_warm_up(self.engine.runner)
        self._thread.start()

    def send(self, message: CoreMessage) -> None:
        self._inbox.put(message)

    def receive(self) -> CoreUpdate | None:
        return self._outbox.get()

    def has_update(self) -> bool:
        """Whether receive() would return without waiting."""
        return not self._outbox.empty()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _take(self, timeout: float | None) -> list[CoreMessage]:
        messages = []
        try:
            if timeout is not None:
                messages.append(self._inbox.get(timeout=timeout))
            while True:
                messages.append(self._inbox.get_nowait())
        except queue.Empty:
            return messages
