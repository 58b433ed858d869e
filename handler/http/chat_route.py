"""Serving OpenAI's chat completions (on /invocations too): parse, render the template (with the
tools), submit, answer whole or stream (n choices interleaved; a call as tool_calls deltas)."""

from __future__ import annotations

import json
from typing import cast

from flask import Response

from engine import RequestError, TokenEvent
from handler.http.adapters import openai_adapter, with_adapters
from handler.http.chat import (
    ChatRequest,
    chat_chunk,
    chat_completion,
    chat_names,
    each_choice,
    parse_chat,
)
from handler.http.choices import one_stream
from handler.http.completions import usage_chunk
from handler.http.direct_stream import LineOf
from handler.http.generation import (
    admit,
    collect_all,
    line_text,
    stream_response,
    submit,
)
from handler.http.schemas import (
    PROBE,
    HTTPError,
    around_probe,
    bad_request,
    fill_probe,
    framed,
)
from handler.http.state import ServerState
from handler.http.tools import CALL_OPEN, CallStream, history


def serve_chat(state: ServerState, body: dict, *, wants_stream: bool, sse: bool,
               start: float) -> Response:
    if "messages" not in body:
        raise bad_request("field messages is required")
    chat = parse_chat(body, wants_stream=wants_stream)
    adapter = openai_adapter(state, body.get("model"))
    model = adapter or state.model_name  # vLLM answers with the adapter's name
    admit(state, chat.n)
    engine = state.engine
    takes_tools = engine.template_takes_tools
    try:
        prompt = engine.encode_chat(history(chat.messages, chat.tools, takes_tools),
                                    tools=chat.tools_for_template if takes_tools else None)
    except RequestError as err:
        raise bad_request(str(err)) from err
    try:
        params = with_adapters(each_choice(chat.params, chat.n), [adapter] * chat.n)
    except RequestError as err:  # e.g. an adapter name past the limit
        raise bad_request(str(err)) from err
    try:
        handles = submit(state, [prompt] * chat.n, params, stream=chat.stream)
    except HTTPError as err:
        if err.code == 400:  # e.g. the length limit, in the chat body's field names
            err.message = chat_names(err.message, chat.max_field)
        raise
    if chat.stream:
        handle, index = one_stream(handles)
        line_of, streams = _chunks(state, chat, index, sse, model)
        trailer = (lambda _: usage_chunk(chat.completion_id, "chat.completion.chunk",
                                         chat.created, model,
                                         # each choice's final event: the group ended well
                                         [cast(TokenEvent, s.last) for s in streams])
                   ) if chat.include_usage else None
        return stream_response(line_of, handle, state, sse=sse, done_line=sse, start=start,
                               trailer=trailer, coalesce=True, direct=True)
    answers = collect_all(state, handles, start)
    return Response(json.dumps(chat_completion(chat, model, answers, decode=engine.decode)),
                    status=200, mimetype="application/json")


class ChoiceStream:
    """One choice's chunks as its events come: content deltas; or, for an answer that is a
    call, tool_calls deltas (the name, then pieces of the arguments). Under `auto` the first
    text decides: the grammar lets only a call start with "<"."""

    def __init__(self, chat: ChatRequest, model: str, decode, index: int = 0) -> None:
        self.chat, self.model, self.decode, self.index = chat, model, decode, index
        tools = chat.tools
        self.call = CallStream(wrapped=False) if tools is not None and tools.choice not in (
            "none", "auto") else None
        self.deciding = tools is not None and tools.choice == "auto"
        self.held: list[TokenEvent] = []  # under auto, tokens with no text yet
        self.first = True
        self.last: TokenEvent | None = None
        # this stream's chunk JSON before and after a plain delta's content (see line())
        self._around = None if chat.logprobs else _around_content(chat, model, index)

    def line(self, chunk: dict, sse: bool) -> str:
        """line_text(chunk, sse); a plain content delta (one per token) is made from the
        stream's chunk JSON around its content: json.dumps's text, ~3x sooner."""
        content = _plain_content(chunk)
        if content is None or self._around is None:
            return line_text(chunk, sse)
        return framed(fill_probe(self._around, content), sse)

    def feed(self, event: TokenEvent) -> list[dict]:
        self.last = event
        chunks = []
        if self.deciding and (event.text or event.finished):
            self.deciding = False
            if event.text.startswith(CALL_OPEN[0]):
                self.call = CallStream(wrapped=True)
            else:  # text after all: the held tokens (no text) go first
                chunks = [self._chunk(early) for early in self.held]
        if self.deciding:
            self.held.append(event)
            return []
        if self.call is None:
            return [*chunks, self._chunk(event)]
        deltas = self.call.feed(event.text)
        if event.finished:
            if self.call.name is None:  # cut before its name: what there is, as text
                return [self._chunk(event._replace(text=self.call.text))]
            deltas = _merged(deltas + self.call.rest())
        if deltas or event.finished or self.first:
            return [self._chunk(event, deltas)]
        return []

    def _chunk(self, event: TokenEvent, tool_calls: list[dict] | None = None) -> dict:
        chunk = chat_chunk(self.chat, self.model, event, first=self.first, decode=self.decode,
                           tool_calls=tool_calls, index=self.index)
        self.first = False
        return chunk


def _around_content(chat: ChatRequest, model: str, index: int) -> tuple[str, str] | None:
    probe = TokenEvent("probe", 0, PROBE, None, 0, 1, None)
    return around_probe(chat_chunk(chat, model, probe, first=False, decode=lambda ids: "",
                                   index=index))


def _plain_content(chunk: dict) -> str | None:
    """The content of a chunk that is only a content delta (no role, finish, logprobs, tool
    call or usage), else None."""
    choices = chunk.get("choices")
    if len(chunk) != 5 or type(choices) is not list or len(choices) != 1:
        return None
    choice = choices[0]
    delta = choice.get("delta")
    if (len(choice) != 4 or choice.get("finish_reason") is not None
            or choice.get("logprobs") is not None or type(delta) is not dict or len(delta) != 1):
        return None
    content = delta.get("content")
    return content if type(content) is str else None


def _merged(entries: list[dict]) -> list[dict]:
    """tool_calls delta entries of one call (index 0) as one entry."""
    if len(entries) < 2:
        return entries
    merged = {**entries[0], "function": dict(entries[0]["function"])}
    merged["function"]["arguments"] = "".join(e["function"].get("arguments", "")
                                              for e in entries)
    return [merged]


def _chunks(state: ServerState, chat: ChatRequest, index: dict[str, int],
            sse: bool, model: str) -> tuple[LineOf, list[ChoiceStream]]:
    """Each choice's chunks, in the order their events come: one line per event, holding
    the event's chunks, none while a tool call is being decided, or several."""
    streams = [ChoiceStream(chat, model, state.engine.decode, i)
               for i in range(chat.n)]

    def line_of(event: TokenEvent) -> str:
        stream = streams[index[event.request_id]]
        return "".join(stream.line(chunk, sse) for chunk in stream.feed(event))

    return line_of, streams
