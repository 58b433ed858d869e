"""EngineLoop: the serving side of the engine. Callers submit and read events; an output thread
turns the core's token ids into text events. The core (engine/core/engine_core.py) schedules
and computes on a thread (ThreadCore) or in a process of its own (ProcessCore)."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

from engine.core.adapters import AdapterList
from engine.core.engine_core import CoreMessage, CoreUpdate
from engine.inputs import AbortRequest, AddRequest, GenerationRequest, StopCore
from engine.outputs import Gauges, StepStats, TokenEvent
from engine.sequence import FinishReason
from engine.serving.adapters import AdapterMirror
from engine.text.output_processor import OutputProcessor, StepOutput

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_POLL_SECONDS = 0.5  # how often a waiting reader re-checks that events can still come
# How often a reader with a cancel check (its client may have gone) runs it: a gone client's
# request is aborted within this, queued or running.
CANCEL_CHECK_SECONDS = 0.1
_ABORT_WAIT_SECONDS = 2.0  # shutdown: how long aborted requests get to receive their end
# At most this many core updates (steps) delivered together by an output thread behind the core.
MAX_UPDATES_AT_ONCE = 64


class QueueFullError(RuntimeError):
    """More requests than running capacity + job_queue_size are in flight (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The loop is not running (loading, crashed or shutting down) (HTTP 503)."""


class Core(Protocol):
    """ThreadCore or ProcessCore: an EngineCore we send messages to and read updates from."""

    initial_gauges: Gauges

    def start(self) -> None: ...
    def send(self, message: CoreMessage) -> None: ...
    def receive(self) -> CoreUpdate | None: ...
    def has_update(self) -> bool: ...
    def is_alive(self) -> bool: ...
    def join(self, timeout: float) -> bool: ...


class RequestHandle:
    """A submitted request: iterate its events; abort() it when the client goes away."""

    def __init__(self, loop: EngineLoop, request_id: str, num_prompt_tokens: int) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self._loop = loop
        self._events: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
        self.finished = False
        self.cancelled = False  # aborted because cancel_when's check said so
        self._cancel_check: Callable[[], bool] | None = None
        self._listener: Callable[[], None] | None = None
        self._delivered_at: list[float] = []  # when each queued event came, in queue order
        self._final = threading.Event()  # set once the final event is queued

    def cancel_when(self, check: Callable[[], bool]) -> None:
        """While events() waits, run `check` every CANCEL_CHECK_SECONDS; once it is true, abort
        the request (e.g. its client closed the connection), so that it frees its KV and, if it
        still waits, is never scheduled. The final event then has finish_reason "abort"."""
        self._cancel_check = check

    def events(self) -> Iterator[TokenEvent]:
        """Yield token events until the final one (which has a finish_reason)."""
        poll = _POLL_SECONDS if self._cancel_check is None else CANCEL_CHECK_SECONDS
        next_check = time.monotonic()  # at once: a client may leave before it is scheduled
        while not self.finished:
            if self._cancel_check is not None and time.monotonic() >= next_check:
                next_check = time.monotonic() + poll
                self.check_cancel()
            try:
                event: TokenEvent | None = self._events.get(timeout=poll)
            except queue.Empty:
                event = None if self.events_may_come() else self._dead_event()
            if event is None:
                continue
            self.finished = event.finished
            yield event

    def all_events(self) -> list[tuple[TokenEvent, float]]:
        """Every event with the monotonic time it was delivered, once the final one has come:
        a reader that needs the whole answer (a non-streaming request) is woken for the end
        alone (and for cancel checks), not for each token as events() is."""
        poll = _POLL_SECONDS if self._cancel_check is None else CANCEL_CHECK_SECONDS
        self.check_cancel()  # at once: a client may leave before it is scheduled
        while not self._final.wait(poll):
            self.check_cancel()
            if not self.events_may_come():
                break
        events = self.take_ready()  # the last ones delivered (events() may have taken some)
        times = self._delivered_at[len(self._delivered_at) - len(events):]
        if not events or not events[-1].finished:  # the output thread stopped without it
            events.append(self.end_unserved())
            times.append(time.monotonic())
        return list(zip(events, times, strict=True))

    def take_ready(self) -> list[TokenEvent]:
        """The events already queued, up to the final one, without waiting: for a reader that
        the output thread drives through on_delivery() (a stream written without its request
        thread). events() then goes on after them."""
        ready: list[TokenEvent] = []
        events = self._events  # next_ready() inlined: the output thread calls this per stream
        while not self.finished and not events.empty():
            event = events.get_nowait()
            self.finished = event.finish_reason is not None
            ready.append(event)
        return ready

    def next_ready(self) -> TokenEvent | None:
        """The next queued event without waiting; None when none is queued or the final one
        was taken (a reader merging several handles takes each event only as it hands it on)."""
        if self.finished or self._events.empty():
            return None
        event = self._events.get_nowait()
        self.finished = event.finished
        return event

    def end_unserved(self) -> TokenEvent:
        """Once the output thread has stopped (events_may_come() is false) and nothing is
        queued: the request's final event, an error (what events() yields then)."""
        self.finished = True
        return self._dead_event()

    def has_queued_events(self) -> bool:
        """Whether events() would yield its next event without waiting."""
        return not self._events.empty()

    def on_delivery(self, listener: Callable[[], None] | None) -> None:
        """Have the output thread call `listener()` after it queues new events for this
        request (None: stop). It runs on the thread that delivers every request's events, so it
        must not block: it lets a server write a stream without waking a thread per token."""
        self._listener = listener

    def events_may_come(self) -> bool:
        """Whether the output thread still runs (it ends every request it leaves)."""
        return self._loop.is_delivering()

    def check_cancel(self) -> None:
        """Run cancel_when's check now (events() runs it every CANCEL_CHECK_SECONDS)."""
        if self._cancel_check is None or self.cancelled or self.finished:
            return
        try:
            gone = self._cancel_check()
        except Exception:  # a broken check must not end a live request
            logger.exception("cancel check failed")
            return
        if gone:
            self.cancelled = True
            self.abort()

    def abort(self) -> None:
        """Stop generating for this request and free its KV (no-op once finished)."""
        if not self.finished:
            self._loop.abort(self.request_id)

    def _dead_event(self) -> TokenEvent:
        return TokenEvent(self.request_id, None, "", None, self.num_prompt_tokens, 0,
                          FinishReason.ERROR.value, "the engine loop stopped")


class EngineLoop:
    """Thread-safe submit/abort with a capacity cap; bounded shutdown; events to handles.

    Requests arrive validated (EngineClient.submit is the boundary). The output thread detokenizes
    each CoreUpdate, so the core never waits on text. A stop string found there goes back to the
    core as an abort: its sequence may compute one more token, which the output processor drops,
    and its KV is freed a step later."""

    def __init__(self, core: Core, tokenizer: PreTrainedTokenizerBase, max_num_seqs: int,
                 max_queued: int, on_step: Callable[[StepStats], None] | None = None,
                 id_prefix: str = "req-", adapters: AdapterList = ()) -> None:
        self.capacity = max_num_seqs + max_queued  # what runs at once plus job_queue_size
        self.output_processor = OutputProcessor(tokenizer)
        self._core = core
        self._on_step = on_step
        self._lock = threading.Lock()
        self._handles: dict[str, RequestHandle] = {}
        self._ids = itertools.count()
        self._id_prefix = id_prefix  # unique to this process when several share one core
        self._accepting = True
        self._stopping = False
        self._gauges = core.initial_gauges
        self._output_thread = threading.Thread(target=self._emit, name="engine-output",
                                               daemon=True)
        # the core's LoRA adapters, as its updates tell them (`adapters`: registered at start)
        self.adapters = AdapterMirror(core.send, id_prefix, adapters, self.is_delivering)

    def start(self) -> None:
        self.adapters.open()
        self._output_thread.start()
        self._core.start()

    def is_alive(self) -> bool:
        return self._core.is_alive() and not self._stopping

    def is_delivering(self) -> bool:
        """Events may still arrive: the output thread runs (it ends every handle it leaves)."""
        return self._output_thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._handles)

    def gauges(self) -> Gauges:
        """The core's latest snapshot, with liveness and in-flight count now."""
        return self._gauges._replace(alive=self.is_alive(), num_in_flight=self.num_in_flight)

    def submit(self, requests: Sequence[GenerationRequest]) -> list[RequestHandle]:
        """Queue validated requests, all or none; raises QueueFullError or EngineDeadError."""
        with self._lock:
            self._check_room(len(requests))
            return [self._queue(request) for request in requests]

    def check_room(self, count: int) -> None:
        with self._lock:
            self._check_room(count)

    def _check_room(self, count: int) -> None:
        if not self._accepting or not self.is_alive():
            raise EngineDeadError("the engine is not accepting requests")
        if len(self._handles) + count > self.capacity:
            raise QueueFullError(f"{len(self._handles)} requests in flight; capacity is "
                                 f"{self.capacity} (max running + job_queue_size)")

    def abort(self, request_id: str) -> None:
        self._core.send(AbortRequest(request_id))

    def shutdown(self, grace_seconds: float) -> None:
        """Stop accepting, let in-flight requests finish within the grace period, abort the rest
        (their final event says "abort": cut off by the shutdown), then stop the core."""
        if self._output_thread.ident is None:  # never started: run it, so the core stops
            self.start()                        # and closes its engine as usual
        with self._lock:
            if self._stopping:
                return
            self._accepting = False
        end = time.monotonic() + grace_seconds
        while self.num_in_flight and time.monotonic() < end and self._core.is_alive():
            time.sleep(0.05)
        with self._lock:
            left = list(self._handles)
        if left:
            logger.warning("shutdown: aborting %d requests still in flight after %.0f s",
                           len(left), grace_seconds)
        for request_id in left:
            self._core.send(AbortRequest(request_id, FinishReason.ABORT, "server shutting down"))
        end = time.monotonic() + _ABORT_WAIT_SECONDS  # their final events, through the core
        while self.num_in_flight and time.monotonic() < end and self._core.is_alive():
            time.sleep(0.01)
        self._stopping = True
        self._core.send(StopCore())
        self._core.join(5)
        self._output_thread.join(5)
        if self._output_thread.is_alive():
            logger.warning("engine output thread did not stop within 5 s")

    def _queue(self, request: GenerationRequest) -> RequestHandle:
        request_id = f"{self._id_prefix}{next(self._ids)}"
        handle = RequestHandle(self, request_id, len(request.prompt_token_ids))
        self._handles[request_id] = handle
        self.output_processor.add(request_id, request.params)
        self._core.send(AddRequest(request_id, request))
        return handle

    # --- the output thread ---

    def _emit(self) -> None:
        try:
            self._emit_until_end()
        finally:
            self.adapters.close()  # no reply comes any more: its callers raise

    def _emit_until_end(self) -> None:
        ended = False
        while not ended:
            updates, ended = self._updates_here()
            if updates:  # first: a caller that sees its end sees its KV freed
                self._gauges = updates[-1].gauges
            for update in updates:
                if update.adapters is not None or update.replies:
                    self.adapters.apply(update)
                if update.stats is not None and self._on_step is not None:
                    try:
                        self._on_step(update.stats)
                    except Exception:  # metrics must never stop the events
                        logger.exception("on_step failed")
            outputs = [out for update in updates for out in update.outputs]
            if outputs:
                self._deliver(outputs)
        with self._lock:  # the core is done: whatever is left never reached it
            handles = list(self._handles.values())
        self._dispatch([handle._dead_event() for handle in handles])

    def _updates_here(self) -> tuple[list[CoreUpdate], bool]:
        """The core's next update, and every later one already here: an output thread that
        fell behind (a busy serving process) catches up by delivering several steps at once,
        one write per stream. True once the core has said its last."""
        update = self._core.receive()
        if update is None:
            return [], True
        updates = [update]
        while len(updates) < MAX_UPDATES_AT_ONCE and self._core.has_update():
            update = self._core.receive()
            if update is None:
                return updates, True
            updates.append(update)
        return updates, False

    def _deliver(self, outputs: list[StepOutput]) -> None:
        """Text and events for the outputs of one or more steps. The requests whose first token
        or end is among them go first, detokenized and written before the others: a client
        waits on those two (a closed loop of clients sends its next request after the end),
        while a token mid-stream loses nothing by going out a few hundred us later."""
        urgent = {out.request_id for out in outputs
                  if out.finish_reason is not None or out.num_output_tokens == 1}
        first = [out for out in outputs if out.request_id in urgent]
        rest = [out for out in outputs if out.request_id not in urgent]
        for part in (first, rest):
            if part:
                self._deliver_part(part)

    def _deliver_part(self, outputs: list[StepOutput]) -> None:
        try:
            events, stopped = self.output_processor.process(outputs)
        except Exception:
            logger.exception("output processing failed; failing the requests it held")
            events, stopped = self._failed(outputs), []
        self._dispatch(events)
        for request_id in stopped:  # the core still runs them: end them there too
            self._core.send(AbortRequest(request_id, FinishReason.STOP))

    def _failed(self, outputs: list[StepOutput]) -> list[TokenEvent]:
        request_ids = dict.fromkeys(out.request_id for out in outputs)
        for request_id in request_ids:
            self.output_processor.discard(request_id)
            self._core.send(AbortRequest(request_id, FinishReason.ERROR))
        return [TokenEvent(rid, None, "", None, 0, 0, FinishReason.ERROR.value,
                           "output processing failed") for rid in request_ids]

    def _dispatch(self, events: list[TokenEvent]) -> None:
        # one call per listener per delivery (the choices of one stream share one)
        listeners: dict[Callable[[], None], None] = {}
        now = time.monotonic()
        with self._lock:
            for event in events:
                handle = self._handles.get(event.request_id)
                if handle is None:
                    continue
                handle._events.put(event)
                handle._delivered_at.append(now)
                if handle._listener is not None:
                    listeners[handle._listener] = None
                if event.finished:
                    del self._handles[event.request_id]
                    handle._final.set()
        for listener in listeners:
            try:
                listener()
            except Exception:  # a listener's failure is its request's, never the others'
                logger.exception("event listener failed")
