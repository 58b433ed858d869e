"""EngineLoop: the engine thread owns the LLMEngine and only schedules and computes; the output
thread turns its token ids into text events and hands them to callers."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from engine.inputs import AbortRequest, AddRequest, GenerationRequest
from engine.llm_engine import LLMEngine
from engine.output_processor import StepOutput
from engine.outputs import Gauges, StepStats, TokenEvent
from engine.sequence import FinishReason

logger = logging.getLogger(__name__)

_POLL_SECONDS = 0.5  # how often a waiting reader re-checks that the loop is alive
_MAX_CONSECUTIVE_FAILURES = 3  # then the loop stops and /ping turns 503

InboxMessage = AddRequest | AbortRequest


class QueueFullError(RuntimeError):
    """More requests than running capacity + job_queue_size are in flight (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The loop is not running (loading, crashed or shutting down) (HTTP 503)."""


class RequestHandle:
    """A submitted request: iterate its events; abort() it when the client goes away."""

    def __init__(self, loop: EngineLoop, request_id: str, num_prompt_tokens: int) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self._loop = loop
        self._events: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
        self.finished = False

    def events(self) -> Iterator[TokenEvent]:
        """Yield token events until the final one (which has a finish_reason)."""
        while not self.finished:
            try:
                event = self._events.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                if not self._loop.is_delivering():
                    event = self._dead_event()
                else:
                    continue
            self.finished = event.finished
            yield event

    def abort(self) -> None:
        """Stop generating for this request and free its KV (no-op once finished)."""
        if not self.finished:
            self._loop.abort(self.request_id)

    def _dead_event(self) -> TokenEvent:
        return TokenEvent(self.request_id, None, "", None, self.num_prompt_tokens, 0,
                          FinishReason.ERROR.value, "the engine loop stopped")


class EngineLoop:
    """Drives the engine in a thread; thread-safe submit/abort; deadlines; bounded shutdown.

    Requests arrive validated (EngineClient.submit is the boundary); the inbox carries
    AddRequest / AbortRequest messages that only the engine thread applies to the engine. The
    engine thread runs engine.step_outputs() and queues the token ids; the output thread
    detokenizes them (engine.output_processor), so the device never waits on text. A stop string
    found there comes back through the inbox as an abort: its sequence may compute one more
    token, which the output processor drops, and its KV is freed a step later."""

    def __init__(self, engine: LLMEngine, max_queued: int,
                 on_step: Callable[[StepStats], None] | None = None) -> None:
        self.engine = engine
        # In flight at most: what can run at once plus job_queue_size waiting.
        self.capacity = engine.config.max_num_seqs + max_queued
        self._on_step = on_step
        self._cond = threading.Condition()
        self._inbox: list[InboxMessage] = []
        self._handles: dict[str, RequestHandle] = {}
        self._deadlines: dict[str, float] = {}
        self._ids = itertools.count()
        self._accepting = True
        self._stopping = False
        self._failures = 0
        self._gauges = engine.gauges()
        # Batches of core outputs in step order; None after the last one.
        self._outputs: queue.SimpleQueue[list[StepOutput] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._output_thread = threading.Thread(target=self._emit, name="engine-output",
                                               daemon=True)

    def start(self) -> None:
        self._output_thread.start()
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def is_delivering(self) -> bool:
        """Events may still arrive: the output thread runs (it ends every handle it leaves)."""
        return self._output_thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        with self._cond:
            return len(self._handles)

    def gauges(self) -> Gauges:
        """The latest snapshot the loop thread took, with liveness and in-flight count now."""
        return dataclasses.replace(self._gauges, alive=self.is_alive(),
                                   num_in_flight=self.num_in_flight)

    def submit(self, requests: Sequence[GenerationRequest]) -> list[RequestHandle]:
        """Queue validated requests, all or none; raises QueueFullError or EngineDeadError."""
        with self._cond:
            if not self._accepting or not self.is_alive():
                raise EngineDeadError("the engine is not accepting requests")
            if len(self._handles) + len(requests) > self.capacity:
                raise QueueFullError(f"{len(self._handles)} requests in flight; capacity is "
                                     f"{self.capacity} (max running + job_queue_size)")
            handles = [self._queue(request) for request in requests]
            self._cond.notify()
        return handles

    def abort(self, request_id: str) -> None:
        with self._cond:
            self._inbox.append(AbortRequest(request_id))
            self._cond.notify()

    def shutdown(self, grace_seconds: float) -> None:
        """Stop accepting, let in-flight requests finish within the grace period, abort the rest."""
        with self._cond:
            self._accepting = False
        end = time.monotonic() + grace_seconds
        while self.num_in_flight and time.monotonic() < end and self._thread.is_alive():
            time.sleep(0.05)
        with self._cond:
            self._stopping = True
            self._cond.notify()
        for thread in (self._thread, self._output_thread):
            thread.join(timeout=5)
            if thread.is_alive():
                logger.warning("%s thread did not stop within 5 s", thread.name)

    def _queue(self, request: GenerationRequest) -> RequestHandle:
        request_id = f"req-{next(self._ids)}"
        handle = RequestHandle(self, request_id, len(request.prompt_token_ids))
        self._handles[request_id] = handle
        if request.deadline is not None:
            self._deadlines[request_id] = request.deadline
        self._inbox.append(AddRequest(request_id, request))
        return handle

    # --- the engine thread ---

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox()
                self._expire(time.monotonic())
                if not self.engine.has_unfinished():
                    self._idle(None)
                    continue
                start = time.perf_counter()
                self._publish(self._step())
                if self.engine.last_batch is None:  # nothing could run: wait for time or input
                    self._idle(self.engine.scheduler.wait_hint())
                elif self._on_step is not None:
                    self._on_step(self.engine.last_step_stats(time.perf_counter() - start))
        except Exception:
            logger.exception("engine loop crashed")
        finally:
            self._abort_all("the engine loop stopped")

    def _step(self) -> list[StepOutput]:
        try:
            outputs = self.engine.step_outputs()
        except Exception:
            self._failures += 1
            if self._failures >= _MAX_CONSECUTIVE_FAILURES:
                raise
            # The failed batch's KV is not trustworthy: fail its requests, keep serving the rest.
            logger.exception("engine step failed; failing the requests of that batch")
            return self.engine.fail_last_batch("engine failure")
        self._failures = 0
        return outputs

    def _idle(self, timeout: float | None) -> None:
        with self._cond:
            if not self._inbox and not self._stopping:
                self._cond.wait(timeout=_POLL_SECONDS if timeout is None else max(timeout, 1e-4))

    def _drain_inbox(self) -> None:
        with self._cond:
            inbox, self._inbox = self._inbox, []
        for message in inbox:
            if isinstance(message, AddRequest):
                self.engine.add_validated(message.request_id, message.request)
            else:
                self._end(message)
        if inbox:
            self._gauges = self.engine.gauges()

    def _expire(self, now: float) -> None:
        with self._cond:
            expired = [rid for rid, t in self._deadlines.items() if t <= now]
        for rid in expired:
            self._end(AbortRequest(rid, FinishReason.TIMEOUT, "predict_timeout exceeded"))
            with self._cond:
                self._deadlines.pop(rid, None)

    def _end(self, message: AbortRequest) -> None:
        output = self.engine.abort(message.request_id, message.reason, message.error)
        self._publish([output] if output else [])

    def _publish(self, outputs: list[StepOutput]) -> None:
        if outputs:  # gauges first: a caller that sees its final event sees its KV freed
            self._gauges = self.engine.gauges()
            self._outputs.put(outputs)

    def _abort_all(self, error: str) -> None:
        with self._cond:
            self._inbox = [m for m in self._inbox if not isinstance(m, AddRequest)]
            request_ids = list(self._handles)
        self._publish([out for rid in request_ids
                       if (out := self.engine.abort(rid, FinishReason.ERROR, error))])
        self._outputs.put(None)

    # --- the output thread ---

    def _emit(self) -> None:
        while (outputs := self._outputs.get()) is not None:
            try:
                events, stopped = self.engine.output_processor.process(outputs)
            except Exception:
                logger.exception("output processing failed; failing the requests it held")
                events, stopped = self._failed(outputs), []
            self._dispatch(events)
            if stopped:
                with self._cond:  # the core still runs them: end them there too
                    self._inbox.extend(AbortRequest(rid, FinishReason.STOP) for rid in stopped)
                    self._cond.notify()
        with self._cond:  # the engine thread is done: whatever is left never reached it
            handles = list(self._handles.values())
        self._dispatch([handle._dead_event() for handle in handles])

    def _failed(self, outputs: list[StepOutput]) -> list[TokenEvent]:
        request_ids = dict.fromkeys(out.request_id for out in outputs)
        for rid in request_ids:
            self.engine.output_processor.discard(rid)
        with self._cond:
            self._inbox.extend(AbortRequest(rid, FinishReason.ERROR) for rid in request_ids)
            self._cond.notify()
        return [TokenEvent(rid, None, "", None, 0, 0, FinishReason.ERROR.value,
                           "output processing failed") for rid in request_ids]

    def _dispatch(self, events: list[TokenEvent]) -> None:
        with self._cond:
            for event in events:
                handle = self._handles.get(event.request_id)
                if handle is None:
                    continue
                handle._events.put(event)
                if event.finished:
                    del self._handles[event.request_id]
                    self._deadlines.pop(event.request_id, None)
