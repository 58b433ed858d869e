"""HandlerRunner: calls a djl_python handler function from worker threads, one request at a
time or, with batch_size > 1, grouped into one batched Input (batch_size + max_batch_delay, as
DJL's dynamic batching), and hands each request its own row of the Output."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from handler.lmi.rows import Row, split_rows

logger = logging.getLogger(__name__)


class RunnerFull(Exception):
    """More requests waiting than job_queue_size."""


@dataclass
class Call:
    """One HTTP request waiting for its row."""

    properties: dict[str, str]
    content: list[tuple[str, bytes]]
    done: threading.Event = field(default_factory=threading.Event)
    row: Row | None = None
    cancelled: bool = False


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
             timeout: float) -> Row | None:
        """This request's row; None when it timed out. Raises RunnerFull."""
        item = Call(properties, content)
        try:
            self._queue.put_nowait(item)
        except queue.Full as err:
            raise RunnerFull(f"{self._queue.maxsize} requests waiting") from err
        if not item.done.wait(timeout):
            item.cancelled = True  # a worker that has not taken it yet skips it
            return None
        return item.row

    def _work(self) -> None:
        while True:
            batch = self._next_batch()
            if batch:
                for item, row in zip(batch, self._run(batch), strict=True):
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
        return [item for item in batch if not item.cancelled]

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
