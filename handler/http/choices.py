"""n choices streamed as one response: their requests' events merged in arrival order."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

from engine import RequestHandle, TokenEvent


def one_stream(handles: list[RequestHandle]
               ) -> tuple[RequestHandle | HandleGroup, dict[str, int]]:
    """What a stream of n choices reads: their handle (a HandleGroup when n > 1), and each
    request id's choice index."""
    handle = handles[0] if len(handles) == 1 else HandleGroup(handles)
    return handle, {h.request_id: i for i, h in enumerate(handles)}


class HandleGroup:
    """The requests of one body's n choices, seen as one handle by stream_response: events()
    merges theirs as they come (one forwarding thread each), abort() ends them all."""

    def __init__(self, handles: list[RequestHandle]) -> None:
        self.handles = handles
        self.request_id = handles[0].request_id
        self.num_prompt_tokens = handles[0].num_prompt_tokens

    @property
    def cancelled(self) -> bool:
        return any(h.cancelled for h in self.handles)

    def abort(self) -> None:
        for handle in self.handles:
            handle.abort()

    def events(self) -> Iterator[TokenEvent]:
        """Every choice's events, until each has its final one."""
        merged: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()

        def forward(handle: RequestHandle) -> None:
            for event in handle.events():
                merged.put(event)

        for handle in self.handles:
            threading.Thread(target=forward, args=(handle,), name="choice-events",
                             daemon=True).start()
        live = len(self.handles)
        while live:
            event = merged.get()
            live -= event.finished
            yield event
