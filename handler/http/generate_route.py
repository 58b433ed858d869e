"""An LMI/TGI generate request on the built-in engine, shaped by the output formatter:
json (LMI objects), jsonlines / sse (stream by default), tgi (TGI lists and SSE)."""

from __future__ import annotations

import itertools

from flask import Response

from engine import TokenEvent
from handler.http.adapters import each_adapter, with_adapters
from handler.http.direct_stream import LineOf
from handler.http.generation import (
    JSONLINES,
    SSE,
    GenerateLines,
    admit,
    collect_all,
    engine_errors,
    stream_response,
    submit,
)
from handler.http.schemas import GenerateRequest, generation_dict, parse_generate
from handler.http.state import ServerState
from handler.http.tgi import tgi_result, tgi_stream_line


def serve_generate(state: ServerState, body: dict, accept: str, start: float) -> Response:
    """Validate, submit every input, answer JSON or a stream as the formatter says."""
    formatters = state.formatters
    name = formatters.output_name
    is_list = isinstance(body.get("inputs"), list)
    sse = SSE in accept or name in ("sse", "tgi")
    wants_stream = JSONLINES in accept or SSE in accept or (
        name in ("jsonlines", "sse") and not is_list)
    gen = parse_generate(body, wants_stream=wants_stream, details_default=name == "tgi")
    admit(state, len(gen.inputs))
    with engine_errors():  # a prompt too long to tokenize
        prompts = [state.engine.encode(text, truncate=gen.truncate) for text in gen.inputs]
    with engine_errors():  # e.g. an adapter name past the limit
        params = with_adapters(gen.params, each_adapter(gen.adapters))
    handles = submit(state, prompts, params, stream=gen.stream)
    decode = state.engine.decode
    if gen.stream:
        reshaped = name == "tgi" or formatters.output_fn is not None
        line_of: LineOf = GenerateLines(gen, decode, None if reshaped else sse)
        if name == "tgi":
            line_of = _tgi_line_of(line_of, gen.params.seed)
        # a custom output formatter (user code) runs on the request thread, never the output one
        return stream_response(formatters.stream(line_of), handles[0], state, sse=sse,
                               done_line=False, start=start, coalesce=True,
                               direct=formatters.output_fn is None)
    answers = collect_all(state, handles, start)  # one failed input aborts the rest
    results = [generation_dict(events, text, gen, decode=decode, prompt_ids=ids)
               for events, text, ids in zip(answers, gen.inputs, prompts, strict=True)]
    return _answer(state, gen, results)


def _answer(state: ServerState, gen: GenerateRequest, results: list[dict]) -> Response:
    if state.formatters.output_name == "tgi":
        # TGI answers a list even for one input.
        payload: object = [tgi_result(r, gen.params.seed) for r in results]
    else:
        payload = results if gen.is_list else results[0]
    body, mimetype = state.formatters.whole(payload)
    return Response(body, status=200, mimetype=mimetype)


def _tgi_line_of(line_of: LineOf, seed: int | None) -> LineOf:
    """TGI's StreamResponse of each event's LMI line, numbered from 0."""
    count = itertools.count()

    def tgi_line(event: TokenEvent) -> dict:
        line = line_of(event)
        assert isinstance(line, dict)  # GenerateLines without sse: JSON objects only
        return tgi_stream_line(line, event, next(count), seed)

    return tgi_line
