"""Serving OpenAI's completions: parse, tokenize, submit, answer whole or as SSE chunks."""

from __future__ import annotations

import json

from flask import Response

from engine import RequestError, TokenEvent
from handler.http.adapters import openai_adapter, with_adapters
from handler.http.chat import each_choice
from handler.http.choices import one_stream
from handler.http.completions import (
    CompletionLines,
    completion,
    completion_names,
    parse_completion,
    usage_chunk,
)
from handler.http.generation import admit, collect_all, stream_response, submit
from handler.http.schemas import HTTPError, bad_request
from handler.http.state import ServerState


def serve_completions(state: ServerState, body: dict, start: float) -> Response:
    req = parse_completion(body)
    adapter = openai_adapter(state, body.get("model"))
    admit(state, len(req.prompts) * req.n)
    try:
        prompts = [state.engine.encode(p) for p in req.prompts]
    except RequestError as err:
        raise bad_request(completion_names(str(err))) from err
    try:
        params = with_adapters(each_choice(req.params, req.n) * len(prompts),
                               [adapter] * len(prompts) * req.n)
    except RequestError as err:  # e.g. an adapter name past the limit
        raise bad_request(completion_names(str(err))) from err
    try:
        handles = submit(state, [ids for ids in prompts for _ in range(req.n)], params,
                         stream=req.stream)
    except HTTPError as err:
        if err.code == 400:  # e.g. the length limit, in the body's own field names
            err.message = completion_names(err.message)
        raise
    model, decode = adapter or state.model_name, state.engine.decode  # vLLM: the adapter's
    if req.stream:  # one prompt, n choices whose chunks interleave
        handle, index = one_stream(handles)
        lasts: dict[int, TokenEvent] = {}
        chunks = CompletionLines(req, model, decode)

        def line_of(event: TokenEvent) -> dict | str:
            i = index[event.request_id]
            line = chunks.line(event, first=i not in lasts, index=i)
            lasts[i] = event
            return line

        trailer = (lambda _: usage_chunk(req.completion_id, "text_completion", req.created,
                                         model, [lasts[i] for i in sorted(lasts)])
                   ) if req.include_usage else None
        return stream_response(line_of, handle, state, sse=True, done_line=True, start=start,
                               trailer=trailer, coalesce=True, direct=True)
    answers = collect_all(state, handles, start)
    return Response(json.dumps(completion(req, model, answers, decode=decode)), status=200,
                    mimetype="application/json")
