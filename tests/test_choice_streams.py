"""A stream of n choices (handler/http/choices.py's HandleGroup): its events merged as the
output thread delivers them, without a thread per choice, each taken only as it is handed on,
and written by the output thread like a lone request's (handler/http/direct_stream.py) until
every choice has its final line."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

from flask import Flask

from engine.outputs import TokenEvent
from engine.serving.loop import EngineLoop, RequestHandle
from handler.http.choices import HandleGroup
from handler.http.direct_stream import DirectWriter, chunk
from handler.http.generation import stream_response
from tests.test_direct_stream import WAIT, _read_exactly, _tcp_pair


def _event(rid: str, i: int, last: bool = False) -> TokenEvent:
    return TokenEvent(rid, 10 + i, f"{rid}{i}", -0.5, 3, i + 1, "length" if last else None)


class _Choices:
    """Two choices' handles on the real EngineLoop's delivery, with no core."""

    def __init__(self) -> None:
        core = SimpleNamespace(initial_gauges=None, send=lambda message: None)
        self.loop = EngineLoop(core, SimpleNamespace(backend_tokenizer=None), 4, 4)
        self.delivering = True
        self.loop.is_delivering = lambda: self.delivering
        self.handles = [RequestHandle(self.loop, rid, 3) for rid in ("a", "b")]
        for handle in self.handles:
            self.loop._handles[handle.request_id] = handle
        self.group = HandleGroup(self.handles)

    def deliver(self, *events: TokenEvent) -> None:
        worker = threading.Thread(target=self.loop._dispatch, args=(list(events),), daemon=True)
        worker.start()
        worker.join(WAIT)
        assert not worker.is_alive(), "delivering the events blocked"

    def written_by_the_output_thread(self) -> bool:
        """Every choice's listener is a DirectWriter's (the reader's own only wakes it)."""
        return all(isinstance(getattr(h._listener, "__self__", None), DirectWriter)
                   for h in self.handles)


def _ids(events: list[TokenEvent]) -> list[str]:
    return [e.text for e in events]


def test_choices_merge_as_delivered_without_a_thread_each() -> None:
    choices = _Choices()
    got: list[TokenEvent] = []
    reader = threading.Thread(target=lambda: got.extend(choices.group.events()), daemon=True)
    before = set(threading.enumerate())
    reader.start()
    choices.deliver(_event("a", 0), _event("b", 0))
    choices.deliver(_event("b", 1, last=True))
    assert set(threading.enumerate()) - before == {reader}  # no thread per choice
    choices.deliver(_event("a", 1, last=True))
    reader.join(WAIT)
    assert not reader.is_alive() and choices.group.finished
    # each choice in its order (across choices, as the reader found them queued)
    assert [e.text for e in got if e.request_id == "a"] == ["a0", "a1"]
    assert [e.text for e in got if e.request_id == "b"] == ["b0", "b1"] and len(got) == 4


def test_a_suspended_reader_holds_no_event_for_the_output_thread() -> None:
    """A stream handed to the output thread after its first line: what came after that line
    is all still queued for take_ready(), none kept by the paused events() generator."""
    choices = _Choices()
    choices.deliver(_event("a", 0), _event("b", 0), _event("a", 1))
    lines = choices.group.events()
    assert next(lines).text == "a0"
    assert _ids(choices.group.take_ready()) == ["a1", "b0"]
    choices.deliver(_event("a", 2, last=True), _event("b", 1, last=True))
    assert _ids(choices.group.take_ready()) == ["a2", "b1"] and choices.group.finished
    assert list(lines) == []


def test_when_the_loop_stops_each_unfinished_choice_ends_with_its_error() -> None:
    choices = _Choices()
    choices.deliver(_event("a", 0, last=True))
    choices.delivering = False
    ends = list(choices.group.events())
    assert [(e.request_id, e.finish_reason) for e in ends] == [("a", "length"), ("b", "error")]


def test_n_choices_are_written_by_the_output_thread_until_each_has_ended() -> None:
    """Through stream_response as the chat and completions routes run it: the first line goes
    through the WSGI body, then each delivery's lines of both choices in one chunk from the
    delivering thread; one choice's end does not end the stream."""
    server, client = _tcp_pair()
    choices = _Choices()
    writers: list[str] = []
    made_on: list[str] = []
    metrics = SimpleNamespace(on_abort=lambda *a: None, on_request=lambda *a: None,
                              on_stream=writers.append)

    def line_of(event: TokenEvent) -> dict:
        made_on.append(threading.current_thread().name)
        return {"id": event.request_id, "text": event.text}

    environ = {"gunicorn.socket": server, "SERVER_PROTOCOL": "HTTP/1.1"}
    try:
        with Flask(__name__).test_request_context("/", method="POST",
                                                  environ_overrides=environ):
            response = stream_response(line_of, choices.group, SimpleNamespace(metrics=metrics),
                                       sse=False, done_line=False, start=0.0, coalesce=True,
                                       direct=True)
        choices.handles[0]._events.put(_event("a", 0))
        body: list[str] = []
        request = threading.Thread(target=lambda: body.extend(response.response),
                                   name="request", daemon=True)
        request.start()
        for _ in range(WAIT * 100):  # the first line went out through the body
            if choices.written_by_the_output_thread():
                break
            threading.Event().wait(0.01)
        assert choices.written_by_the_output_thread(), "the writer never listened"

        def line(rid: str, i: int) -> bytes:
            return json.dumps({"id": rid, "text": f"{rid}{i}"}).encode() + b"\n"
        for events, lines in (((_event("a", 1), _event("b", 0)), line("a", 1) + line("b", 0)),
                              ((_event("a", 2, last=True),), line("a", 2)),
                              ((_event("b", 1, last=True),), line("b", 1))):
            choices.deliver(*events)
            assert _read_exactly(client, len(chunk(lines))) == chunk(lines)
        request.join(WAIT)
        assert not request.is_alive()
        assert [json.loads(text)["text"] for text in "".join(body).splitlines()] == ["a0"]
        assert writers == ["output_thread"] and made_on.count("request") == 1
        assert all(h._listener is None for h in choices.handles)
    finally:
        server.close()
        client.close()


def test_choices_sharing_a_listener_wake_it_once_per_delivery() -> None:
    choices = _Choices()
    calls: list[int] = []
    choices.group.on_delivery(lambda: calls.append(1))
    choices.deliver(_event("a", 0), _event("b", 0))
    assert len(calls) == 1 and choices.group.has_queued_events()


def test_one_choice_that_fails_makes_the_stream_an_error_without_usage() -> None:
    """Judged by every choice's end, not by the last line written: choice a's error is the
    stream's status (500), and no usage line follows though b ended normally after it."""
    choices = _Choices()
    statuses: list[int] = []
    metrics = SimpleNamespace(on_abort=lambda *a: None, on_stream=lambda *a: None,
                              on_request=lambda status, *a: statuses.append(status))
    response = stream_response(lambda e: {"text": e.text}, choices.group,
                               SimpleNamespace(metrics=metrics), sse=False, done_line=False,
                               start=0.0, coalesce=True, trailer=lambda e: {"usage": 1})
    failed = TokenEvent("a", None, "", None, 3, 1, "error", "internal")
    choices.deliver(_event("a", 0), _event("b", 0), failed)
    choices.deliver(_event("b", 1, last=True))
    lines = [json.loads(line) for line in "".join(response.response).splitlines()]
    assert [line.get("text") for line in lines] == ["a0", "b0", None, "b1"]
    assert "usage" not in lines[-1] and statuses == [500]
