"""HandlerRunner: calls a djl_python handler function from worker threads, one request at a
time or, with batch_size > 1, grouped into one batched Input (batch_size + max_batch_delay, as
DJL's dynamic batching), and hands each request its own row of the Output.

A call whose client has left is dropped before it starts (its HTTP thread polls the client's
socket while the call waits, and a worker checks it once more as it takes the call); a running
call cannot be stopped (the handler is user code) and runs to its end. shutdown() drains: no new
calls, those in flight and the streams being written get the grace period, then each call still
waiting ends with CallAborted("shutdown"), and each stream with it before its next item."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from handler.lmi.rows import Row, split_rows

logger = logging.getLogger(__name__)


POLL_SECONDS = 0.1  # how often a queued call checks that its client is still there


class RunnerFull(Exception):
    """More requests waiting than job_queue_size."""


class CallAborted(Exception):
    """A call ended without the handler's answer: its client left before it started
    (reason "client_disconnect"), or the server's drain ended first ("shutdown")."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(eq=False)
class Call:
    """One HTTP request waiting for its row."""

    properties: dict[str, str]
    content: list[tuple[str, bytes]]
    gone: Callable[[], bool] | None = None  # whether the client closed its connection
    done: threading.Event = field(default_factory=threading.Event)
    row: Row | None = None
    cancelled: bool = False  # never to start: timed out, its client left, or the drain ended
    started: bool = False
    aborted: str | None = None  # CallAborted's reason, when it ends without a row


class HandlerRunner:
    """Owns the handler function; `workers` threads call it (DJL's maxWorkers)."""

    # make_input: djl_python's Input class (handler/lmi/djl_compat), imported at run time
    def __init__(self, function: Callable, make_input: Callable[[], Any], *,
                 batch_size: int = 1, max_batch_delay_s: float = 0.1, workers: int = 1,
                 queue_size: int = 1000) -> None:
        self._function = function
        self._make_input = make_input
        self._batch_size = batch_size
        self._delay = max_batch_delay_s
        self._workers = workers
        self._queue: queue.Queue[Call] = queue.Queue(maxsize=max(queue_size, 1))
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified as calls in flight end
        self._in_flight: set[Call] = set()  # HTTP requests waiting for their row
        self._streams: set[_Stream] = set()  # handler streams being written
        self._accepting = True
        self._cut = False  # the drain is over: streams stop before their next item

    def initialize(self, properties: dict[str, str]) -> None:
        """The start-up call: an empty Input carrying the model's properties. Raises what the
        handler raises (the server then fails to load)."""
        inputs = self._make_input()
        inputs.properties.update(properties)
        self._function(inputs)

    def start(self) -> None:
        for i in range(self._workers):
            thread = threading.Thread(target=self._work, name=f"handler-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def alive(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def call(self, properties: dict[str, str], content: list[tuple[str, bytes]],
             timeout: float, gone: Callable[[], bool] | None = None) -> Row | None:
        """This request's row; None when it timed out. Raises RunnerFull, or CallAborted
        when `gone` says the client left before the call started, or the drain ended."""
        item = Call(properties, content, gone)
        with self._lock:
            if not self._accepting:
                raise CallAborted("shutdown")
            self._in_flight.add(item)
        row: Row | None = None
        try:
            try:
                self._queue.put_nowait(item)
            except queue.Full as err:
                raise RunnerFull(f"{self._queue.maxsize} requests waiting") from err
            row = self._wait(item, time.monotonic() + timeout)
        finally:
            with self._lock:
                self._in_flight.discard(item)
                self._idle.notify_all()
                if row is not None and row.stream is not None:
                    # still in flight, for the drain, until the stream is written
                    stream = _Stream(self, row.stream)
                    self._streams.add(stream)
                    row = replace(row, stream=stream)
        return row

    def _wait(self, item: Call, deadline: float) -> Row | None:
        while not item.done.wait(min(POLL_SECONDS, max(deadline - time.monotonic(), 0))):
            if time.monotonic() >= deadline:
                item.cancelled = True  # a worker that has not taken it yet skips it
                return None
            if item.gone is not None and not item.started and item.gone():
                self._drop(item, "client_disconnect")
        if item.aborted is not None:
            raise CallAborted(item.aborted)
        return item.row

    def _drop(self, item: Call, reason: str) -> None:
        """End a call that has not started: it never will."""
        with self._lock:
            if item.started or item.done.is_set():
                return
            item.cancelled, item.aborted = True, reason
            item.done.set()

    def shutdown(self, grace_seconds: float) -> None:
        """Take no more calls; let those in flight (queued or running) be answered within
        grace_seconds; then end each still waiting with CallAborted("shutdown") (a queued one
        never starts; a running handler call cannot be stopped: it ends with the process)."""
        started = time.monotonic()
        with self._lock:
            self._accepting = False
            waiting = len(self._in_flight) + len(self._streams)
            if waiting:
                logger.info("shutdown: waiting up to %g s for %d custom handler calls in "
                            "flight", grace_seconds, waiting)
            while ((self._in_flight or self._streams)
                   and (left := started + grace_seconds - time.monotonic()) > 0):
                self._idle.wait(left)
            # a call whose row is set but whose thread has not woken yet keeps its answer
            cut = [item for item in self._in_flight if not item.done.is_set()]
            for item in cut:
                item.cancelled, item.aborted = True, "shutdown"
                item.done.set()
            self._cut = True
            streams = len(self._streams)
        if cut or streams:
            logger.warning("shutdown: aborting %d custom handler calls still in flight after "
                           "%.0f s", len(cut) + streams, grace_seconds)
        elif waiting:
            logger.info("shutdown: the %d custom handler calls in flight ended in %.1f s",
                        waiting, time.monotonic() - started)

    def _stream_ended(self, stream: _Stream) -> None:
        with self._lock:
            self._streams.discard(stream)
            self._idle.notify_all()

    def _work(self) -> None:
        while True:
            batch = self._next_batch()
            if batch:
                for item, row in zip(batch, self._run(batch), strict=True):
                    with self._lock:  # not when the drain has ended it meanwhile
                        if not item.done.is_set():
                            item.row = row
                            item.done.set()

    def _next_batch(self) -> list[Call]:
        batch = [self._queue.get()]
        deadline = time.monotonic() + self._delay
        while len(batch) < self._batch_size:
            remaining = deadline - time.monotonic()
            try:
                batch.append(self._queue.get(timeout=max(remaining, 0)) if remaining > 0
                             else self._queue.get_nowait())
            except queue.Empty:
                break
        return [item for item in batch if self._claim(item)]

    def _claim(self, item: Call) -> bool:
        """Whether to run this call now: not when it was cancelled or its client has left."""
        if not item.cancelled and item.gone is not None and item.gone():
            self._drop(item, "client_disconnect")
        with self._lock:
            if item.cancelled:
                return False
            item.started = True
            return True

    def _run(self, batch: list[Call]) -> list[Row]:
        inputs = self._batched_input(batch)
        try:
            output = self._function(inputs)
        except BaseException as err:  # noqa: B036 — a handler must never end its worker
            logger.warning("handler raised %s: %s", type(err).__name__, err)
            return [Row.failed(err)] * len(batch)
        return split_rows(output, len(batch))

    def _batched_input(self, batch: list[Call]):
        """One request as it came; N > 1 as DJL sends them: batch_size=N and every property
        and content key prefixed batch_NNN."""
        inputs = self._make_input()
        if len(batch) == 1:
            inputs.properties.update(batch[0].properties)
            for key, value in batch[0].content:
                inputs.content.add(key, value)
            return inputs
        inputs.properties["batch_size"] = str(len(batch))
        for i, item in enumerate(batch):
            for key, text in item.properties.items():
                inputs.properties[f"batch_{i:03d}.{key}"] = text
            for key, value in item.content:
                inputs.content.add(f"batch_{i:03d}.{key}", value)
        return inputs


class _Stream:
    """A row's stream while it is written: in flight for the drain until it ends or is closed;
    once the drain's time is up, it raises CallAborted("shutdown") before its next item."""

    def __init__(self, runner: HandlerRunner, items: Iterable) -> None:
        self._runner = runner
        self._items: Iterator = iter(items)
        self._closed = False

    def __iter__(self) -> Iterator:
        return self

    def __next__(self):
        if self._runner._cut:
            self.close()
            raise CallAborted("shutdown")
        try:
            return next(self._items)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._runner._stream_ended(self)
