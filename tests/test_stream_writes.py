"""Streamed /invocations responses write every event already queued in one chunk (one syscall,
one trip through gunicorn), and each event at once when none waits behind it; the bytes are the
same, and nothing made before a failure is held back."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from engine.outputs import TokenEvent
from engine.serving.loop import RequestHandle
from handler.cli import CORE_OPENMP_SPIN_COUNT, brief_openmp_spin
from handler.http.chat import parse_chat
from handler.http.chat_route import ChoiceStream, _plain_content
from handler.http.completions import CompletionLines, completion_chunk, parse_completion
from handler.http.generation import GenerateLines, line_text, stream_response
from handler.http.schemas import GenerateRequest, parse_generate, token_dict, token_line

NUM_EVENTS = 5


def _events() -> list[TokenEvent]:
    return [TokenEvent("r", 10 + i, f"t{i}", -0.5, 3, i + 1,
                       "length" if i == NUM_EVENTS - 1 else None) for i in range(NUM_EVENTS)]


def _line_of(fail_at: int | None = None):
    made = []

    def line_of(e: TokenEvent) -> dict:
        if len(made) == fail_at:
            raise RuntimeError("an output formatter failed")
        made.append(e)
        return {"token": {"id": e.token_id, "text": e.text}}
    return line_of


def _response(handle: RequestHandle, sse: bool = False, coalesce: bool = True,
              fail_at: int | None = None):
    metrics = SimpleNamespace(on_abort=lambda *a: None, on_request=lambda *a: None,
                              on_stream=lambda *a: None)
    return stream_response(_line_of(fail_at), handle, SimpleNamespace(metrics=metrics),
                           sse=sse, done_line=sse, start=0.0, coalesce=coalesce)


def _expected(sse: bool) -> str:
    body = [json.dumps({"token": {"id": e.token_id, "text": e.text}}) for e in _events()]
    if sse:
        return "".join(f"data: {b}\n\n" for b in body) + "data: [DONE]\n\n"
    return "".join(b + "\n" for b in body)


def _handle() -> RequestHandle:
    return RequestHandle(SimpleNamespace(is_delivering=lambda: True, abort=lambda rid: None),
                         "r", 3)


def test_events_already_queued_go_out_in_one_chunk() -> None:
    for sse in (False, True):
        handle = _handle()
        for event in _events():
            handle._events.put(event)
        chunks = list(_response(handle, sse).response)
        assert "".join(chunks) == _expected(sse)
        assert len(chunks) == (2 if sse else 1)  # the lines, then [DONE]


def test_each_event_goes_out_at_once_when_none_waits() -> None:
    handle = _handle()
    chunks = iter(_response(handle).response)
    written = []
    for event in _events():
        handle._events.put(event)
        written.append(next(chunks))  # returns without the next event: nothing held back
    assert list(chunks) == []
    assert len(written) == NUM_EVENTS and "".join(written) == _expected(False)


def test_without_coalescing_every_line_is_its_own_chunk() -> None:
    """Routes whose lines are not one per event (chat's tool calls may hold an event back)
    write each line at once, queued or not."""
    handle = _handle()
    for event in _events():
        handle._events.put(event)
    chunks = list(_response(handle, coalesce=False).response)
    assert len(chunks) == NUM_EVENTS and "".join(chunks) == _expected(False)


def test_lines_made_before_a_failure_are_written() -> None:
    handle = _handle()
    for event in _events():
        handle._events.put(event)
    chunks = iter(_response(handle, fail_at=2).response)
    assert next(chunks) == "".join(_expected(False).splitlines(keepends=True)[:2])
    with pytest.raises(RuntimeError, match="formatter failed"):
        next(chunks)


def test_core_process_openmp_spins_briefly_unless_the_user_chose() -> None:
    environ: dict[str, str] = {}
    brief_openmp_spin(environ)
    assert environ == {"GOMP_SPINCOUNT": str(CORE_OPENMP_SPIN_COUNT)}
    for chosen in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "ACTIVE"},
                   {"GOMP_SPINCOUNT": "10000"}):
        environ = dict(chosen)
        brief_openmp_spin(environ)
        assert environ == chosen


TEXTS = ["", " hello", "é", "日本語", "🙂", 'say "hi"\\', "tab\tnew\nline\r\x00\x1f\x7f", "\ud800"]
LOGPROBS = [None, -0.5, 0.0, -0.0, -1e-300, -123456.789, -2.220446049250313e-16]


def _stream_request(**parameters) -> GenerateRequest:
    return parse_generate({"inputs": "hi", "parameters": {"max_new_tokens": 4, **parameters},
                           "stream": True}, wants_stream=True)


@pytest.mark.parametrize("sse", [False, True])
def test_a_token_line_is_the_text_json_dumps_makes(sse) -> None:
    """GenerateLines writes a plain token line itself; its text is json.dumps's, framed."""
    for i, (text, logprob) in enumerate((t, lp) for t in TEXTS for lp in LOGPROBS):
        event = TokenEvent("r", i * 7919, text, logprob, 3, 1, None)
        line = {"token": token_dict(event)}
        assert token_line(event) == json.dumps(line)
        made = GenerateLines(_stream_request(), lambda ids: "", sse)(event)
        assert made == line_text(line, sse)  # text: the fast path, not a dict


@pytest.mark.parametrize("event", [
    TokenEvent("r", 1, "a", float("nan"), 3, 1, None),  # json.dumps writes NaN
    TokenEvent("r", 1, "a", float("-inf"), 3, 1, None),
    TokenEvent("r", True, "a", -1.0, 3, 1, None),
    TokenEvent("r", 1, "a", -1, 3, 1, None),  # an int log_prob
    TokenEvent("r", None, "", None, 3, 0, None),  # no token
])
def test_any_other_token_line_is_left_to_json_dumps(event) -> None:
    assert token_line(event) is None
    line = GenerateLines(_stream_request(), lambda ids: "", False)(event)
    assert type(line) is dict and line_text(line, False) == json.dumps(line) + "\n"


def test_generate_lines_are_objects_where_something_reshapes_them() -> None:
    """Without sse (TGI's lines, an output formatter), every line is a JSON object; the last
    holds the whole text and details; top_tokens lines are objects either way."""
    events = [TokenEvent("r", 10 + i, t, -0.5, 3, i + 1, "length" if i == 2 else None)
              for i, t in enumerate(["a", "b", "c"])]
    make = GenerateLines(_stream_request(details=True), lambda ids: "", None)
    lines = [make(e) for e in events]
    assert lines[0] == {"token": {"id": 10, "text": "a", "log_prob": -0.5}}
    assert lines[2]["generated_text"] == "abc"
    assert lines[2]["details"] == {"finish_reason": "length", "generated_tokens": 3,
                                   "inputs": 3}
    with_top = GenerateLines(_stream_request(top_n_tokens=1), lambda ids: "x", False)
    assert "top_tokens" in with_top(events[0])


def _chat_events(texts: list[str]) -> list[TokenEvent]:
    return [TokenEvent("r", 10 + i, text, -0.25, 3, i + 1,
                       "length" if i == len(texts) - 1 else None) for i, text in enumerate(texts)]


@pytest.mark.parametrize("body", [
    {},
    {"n": 2, "stream_options": {"include_usage": True}},
    {"logprobs": True, "top_logprobs": 2},  # every chunk carries logprobs: json.dumps
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
])
@pytest.mark.parametrize("sse", [False, True])
def test_a_chat_streams_lines_are_the_text_json_dumps_makes(body, sse) -> None:
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}], "stream": True, **body},
                      wants_stream=True)
    texts = ["", "Hé", " 日本", '"q"\\', "\n\t\x01", "🙂", "end"]
    for index in range(chat.n):
        stream = ChoiceStream(chat, "m/odel", lambda ids: "x", index)
        chunks = [c for event in _chat_events(texts) for c in stream.feed(event)]
        assert [stream.line(c, sse) for c in chunks] == [line_text(c, sse) for c in chunks]
        plain = [c for c in chunks if _plain_content(c) is not None]
        # the middle tokens' chunks take the template, unless logprobs ride on every chunk
        assert len(plain) == (0 if chat.logprobs else len(texts) - 2)


def test_only_a_plain_content_delta_takes_the_template() -> None:
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"content": "a"}, "logprobs": None,
                          "finish_reason": None}]}
    assert _plain_content(chunk) == "a"
    for change in ({"usage": {}}, {"choices": []}, {"choices": [chunk["choices"][0]] * 2}):
        assert _plain_content({**chunk, **change}) is None
    for choice in ({"delta": {"role": "assistant", "content": "a"}}, {"finish_reason": "stop"},
                   {"logprobs": {"content": []}}, {"delta": {"tool_calls": []}},
                   {"delta": {"content": None}}):
        assert _plain_content({**chunk, "choices": [{**chunk["choices"][0], **choice}]}) is None


@pytest.mark.parametrize("body", [
    {},
    {"echo": True, "n": 2},
    {"logprobs": 2},  # every token's chunk carries logprobs: json.dumps
    {"stream_options": {"include_usage": True}},
])
def test_a_completion_streams_lines_are_the_text_json_dumps_makes(body) -> None:
    req = parse_completion({"prompt": "Say é", "stream": True, **body})
    texts = ["", "Hé", " 日本", '"q"\\', "\n\t\x01", "🙂", "end"]
    for index in range(req.n):
        chunks = CompletionLines(req, "m/odel", lambda ids: "x")
        made = [chunks.line(e, first=i == 0, index=index)
                for i, e in enumerate(_chat_events(texts))]
        expected = [completion_chunk(req, "m/odel", e, first=i == 0, decode=lambda ids: "x",
                                     index=index) for i, e in enumerate(_chat_events(texts))]
        assert [m if isinstance(m, str) else line_text(m, True) for m in made] == [
            line_text(e, True) for e in expected]
        templated = sum(isinstance(m, str) for m in made)
        # the middle tokens, and the first unless echo puts the prompt before it
        assert templated == (0 if req.logprobs is not None
                             else len(texts) - 1 - (1 if req.echo else 0))
