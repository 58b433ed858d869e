"""Serving OpenAI's chat completions (on /invocations too): parse, render the template (with the
tools), submit, answer whole or stream; a tool-call answer streams as one tool_calls delta."""

from __future__ import annotations

import json
from collections.abc import Iterator

from flask import Response

from engine import RequestError, TokenEvent
from handler.http.chat import (
    ChatRequest,
    chat_chunk,
    chat_completion,
    chat_names,
    each_choice,
    parse_chat,
)
from handler.http.completions import usage_chunk
from handler.http.generation import Lines, admit, collect, stream_response, submit
from handler.http.schemas import HTTPError, bad_request
from handler.http.state import ServerState
from handler.http.tools import CALL_OPEN, CallStream, history


def serve_chat(state: ServerState, body: dict, *, wants_stream: bool, sse: bool,
               start: float) -> Response:
    if "messages" not in body:
        raise bad_request("field messages is required")
    chat = parse_chat(body, wants_stream=wants_stream)
    admit(state, chat.n)
    engine = state.engine
    takes_tools = engine.template_takes_tools
    try:
        prompt = engine.encode_chat(history(chat.messages, chat.tools, takes_tools),
                                    tools=chat.tools_for_template if takes_tools else None)
    except RequestError as err:
        raise bad_request(str(err)) from err
    try:
        handles = submit(state, [prompt] * chat.n, each_choice(chat.params, chat.n),
                         stream=chat.stream)
    except HTTPError as err:
        if err.code == 400:  # e.g. the length limit, in the chat body's field names
            err.message = chat_names(err.message, chat.max_field)
        raise
    if chat.stream:
        [handle] = handles
        trailer = (lambda last: usage_chunk(chat.completion_id, "chat.completion.chunk",
                                            chat.created, state.model_name, last)
                   ) if chat.include_usage else None
        lines = _chunks(state, chat, handle.events())
        return stream_response(lines, handle, state, sse=sse, done_line=sse, start=start,
                               trailer=trailer)
    answers = [collect(state, handle, start) for handle in handles]
    return Response(json.dumps(chat_completion(chat, state.model_name, answers,
                                               decode=engine.decode)),
                    status=200, mimetype="application/json")


def _chunks(state: ServerState, chat: ChatRequest, events: Iterator[TokenEvent]) -> Lines:
    """Content deltas as tokens come; an answer that is a call streams as tool_calls deltas
    (the name, then pieces of the arguments). Under `auto` the first text decides: the grammar
    lets only a call start with "<"."""
    model, decode = state.model_name, state.engine.decode
    tools = chat.tools
    call = CallStream(wrapped=False) if tools is not None and tools.choice not in (
        "none", "auto") else None
    deciding = tools is not None and tools.choice == "auto"
    held: list[TokenEvent] = []  # under auto, tokens with no text yet
    first = True
    for event in events:
        if deciding and (event.text or event.finished):
            deciding = False
            if event.text.startswith(CALL_OPEN[0]):
                call = CallStream(wrapped=True)
            for early in held:  # no text: nothing a call would show
                if call is None:
                    yield chat_chunk(chat, model, early, first=first, decode=decode), early
                    first = False
        if deciding:
            held.append(event)
            continue
        if call is None:
            yield chat_chunk(chat, model, event, first=first, decode=decode), event
            first = False
            continue
        deltas = call.feed(event.text)
        if deltas or event.finished or first:
            yield chat_chunk(chat, model, event, first=first, decode=decode,
                             tool_calls=deltas), event
            first = False
