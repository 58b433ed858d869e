"""Running one generation for the HTTP edge: submit to the engine loop, wait for a whole
answer, or stream it line by line (a client that goes away aborts its request)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator

from flask import Response

from engine import (
    EngineDeadError,
    GenerationRequest,
    QueueFullError,
    RequestError,
    RequestHandle,
    SamplingParams,
    TokenEvent,
)
from handler.http.chat import ChatRequest, chat_chunk
from handler.http.schemas import (
    Decode,
    GenerateRequest,
    HTTPError,
    bad_request,
    details_dict,
    final_error,
    token_dict,
    top_tokens,
)
from handler.http.state import ServerState

logger = logging.getLogger(__name__)

JSONLINES = "application/jsonlines"
SSE = "text/event-stream"
# (JSON object, or text an output formatter made, to write; the event it reports)
Lines = Iterator[tuple[dict | str | bytes, TokenEvent]]


def submit(state: ServerState, prompts: list[list[int]], params: SamplingParams, *,
           stream: bool) -> list[RequestHandle]:
    """Queue every prompt, or none: an invalid one, a full queue or a dead engine is an HTTP
    error and nothing of the request stays queued."""
    deadline = None if stream else time.monotonic() + state.config.predict_timeout
    requests = [GenerationRequest(tuple(ids), params, deadline) for ids in prompts]
    try:
        return state.engine.submit_all(requests)
    except RequestError as err:
        raise bad_request(str(err)) from err
    except QueueFullError as err:
        raise HTTPError(503, "QueueFull", f"too many requests in flight: {err}; raise "
                        "job_queue_size or retry later", {"Retry-After": "1"}) from err
    except EngineDeadError as err:
        raise HTTPError(503, "ServiceUnavailable", str(err)) from err


def collect(state: ServerState, handle: RequestHandle, start: float) -> list[TokenEvent]:
    """Wait for a non-streaming request's events; an abnormal end becomes an HTTP error."""
    events, times = [], []
    for event in handle.events():
        events.append(event)
        if event.token_id is not None:
            times.append(time.monotonic())
    error = final_error(events[-1])
    status = error.code if error else 200
    state.metrics.on_request(status, handle.num_prompt_tokens, times, start, time.monotonic())
    _log(handle, events[-1], start, times)
    if error is not None:
        error.counted = True
        raise error
    return events


def generate_lines(gen: GenerateRequest, handle: RequestHandle, decode: Decode) -> Lines:
    events: list[TokenEvent] = []
    for event in handle.events():
        events.append(event)
        line: dict = {}
        if event.token_id is not None:
            line["token"] = token_dict(event)
            if gen.top_n_tokens:
                line["top_tokens"] = top_tokens(event, decode)
        if event.finished:
            text = "".join(e.text for e in events)
            line["generated_text"] = (gen.inputs[0] + text) if gen.return_full_text else text
            line["details"] = details_dict(events, with_tokens=False)
        yield line, event


def chat_lines(state: ServerState, chat: ChatRequest, handle: RequestHandle) -> Lines:
    first = True
    for event in handle.events():
        yield chat_chunk(chat, state.model_name, event, first=first,
                         decode=state.engine.decode), event
        first = False


def stream_response(lines: Lines, handle: RequestHandle, state: ServerState, *, sse: bool,
                    done_line: bool, start: float) -> Response:
    """Write lines as they come; a client that goes away aborts its request (frees its KV)."""

    def generate() -> Iterator[str | bytes]:
        times, last = [], None
        try:
            for line, event in lines:
                last = event
                if event.token_id is not None:
                    times.append(time.monotonic())
                error = final_error(event) if event.finished else None
                if error is not None:
                    line = {**error.body(), "error": error.message,
                            "details": {"finish_reason": "error"}}
                if isinstance(line, str | bytes):  # an output formatter wrote it
                    yield line
                else:
                    yield f"data: {json.dumps(line)}\n\n" if sse else json.dumps(line) + "\n"
            if done_line:  # OpenAI's end-of-stream marker
                yield "data: [DONE]\n\n"
        finally:
            handle.abort()  # no-op when finished; frees KV when the client disconnected
            status = _stream_status(last)
            state.metrics.on_request(status, handle.num_prompt_tokens, times, start,
                                     time.monotonic())
            if last is not None:
                _log(handle, last, start, times)

    return Response(generate(), mimetype=SSE if sse else JSONLINES,
                    headers={"X-Accel-Buffering": "no", "Cache-Control": "no-cache"})


def _stream_status(last: TokenEvent | None) -> int:
    if last is None or not last.finished:
        return 499  # the client closed the connection first
    error = final_error(last)
    return error.code if error else 200


def _log(handle: RequestHandle, last: TokenEvent, start: float, times: list[float]) -> None:
    ttft = f"{(times[0] - start) * 1000:.0f}" if times else "-"
    logger.info("request %s: %d prompt tokens, %d generated, finish %s, ttft %s ms, total %.0f ms",
                handle.request_id, handle.num_prompt_tokens, last.num_output_tokens,
                last.finish_reason, ttft, (time.monotonic() - start) * 1000)
