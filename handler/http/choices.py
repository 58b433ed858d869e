"""n choices streamed as one response: their requests' events merged as they are delivered."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

from engine import CANCEL_CHECK_SECONDS, RequestHandle, TokenEvent


def one_stream(handles: list[RequestHandle]
               ) -> tuple[RequestHandle | HandleGroup, dict[str, int]]:
    """What a stream of n choices reads: their handle (a HandleGroup when n > 1), and each
    request id's choice index."""
    handle = handles[0] if len(handles) == 1 else HandleGroup(handles)
    return handle, {h.request_id: i for i, h in enumerate(handles)}


class HandleGroup:
    """The requests of one body's n choices, read as one RequestHandle: by events() on the
    request thread, or by take_ready() from the output thread's on_delivery() call (a stream
    written without its request thread, handler/http/direct_stream.py). Each choice's events
    keep their order; it ends once every choice has its final event."""

    def __init__(self, handles: list[RequestHandle]) -> None:
        self.handles = handles
        self.request_id = handles[0].request_id
        self.num_prompt_tokens = handles[0].num_prompt_tokens

    @property
    def finished(self) -> bool:
        return all(h.finished for h in self.handles)

    @property
    def cancelled(self) -> bool:
        return any(h.cancelled for h in self.handles)

    def abort(self) -> None:
        for handle in self.handles:
            handle.abort()

    def take_ready(self) -> list[TokenEvent]:
        return [event for handle in self.handles for event in handle.take_ready()]

    def has_queued_events(self) -> bool:
        return any(h.has_queued_events() for h in self.handles)

    def on_delivery(self, listener: Callable[[], None] | None) -> None:
        for handle in self.handles:
            handle.on_delivery(listener)

    def events_may_come(self) -> bool:
        return self.handles[0].events_may_come()  # one loop delivers them all

    def check_cancel(self) -> None:
        for handle in self.handles:
            handle.check_cancel()

    def events(self) -> Iterator[TokenEvent]:
        """Every choice's events, until each has its final one, each taken from its queue only
        as it is yielded (a stream handed to the output thread between two finds none held
        here). Woken by the output thread's delivery (listening again at each wait: a direct
        writer may have listened meanwhile), not by a thread per choice."""
        delivered = threading.Event()
        next_check = time.monotonic()  # at once: a client may leave before it is scheduled
        while not self.finished:
            delivered.clear()
            self.on_delivery(delivered.set)
            taken = False
            for handle in self.handles:  # one at a time: none held while this one is written
                event = handle.next_ready()
                if event is not None:
                    taken = True
                    yield event
            if taken:
                continue
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + CANCEL_CHECK_SECONDS
                self.check_cancel()
            if not self.events_may_come():  # what is queued, then each unfinished choice's end
                for handle in self.handles:
                    while (event := handle.next_ready()) is not None:
                        yield event
                    if not handle.finished:
                        yield handle.end_unserved()
                return
            delivered.wait(CANCEL_CHECK_SECONDS)
