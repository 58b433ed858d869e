"""Flask app: GET /ping, POST /invocations (+ /v1/chat/completions), GET /metrics."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator

from flask import Flask, Response, request
from werkzeug.exceptions import HTTPException

from engine import EngineDeadError, QueueFullError, RequestError, RequestHandle, TokenEvent
from handler.chat import ChatRequest, chat_chunk, chat_completion, parse_chat
from handler.schemas import (
    GenerateRequest,
    HTTPError,
    bad_request,
    details_dict,
    final_error,
    generation_dict,
    parse_generate,
    token_dict,
)
from handler.state import ServerState

logger = logging.getLogger(__name__)

JSONLINES = "application/jsonlines"
SSE = "text/event-stream"
Lines = Iterator[tuple[dict, TokenEvent]]  # (JSON object to write, the event it reports)


def create_app(state: ServerState) -> Flask:
    """The WSGI app over one ServerState (one gunicorn worker, many threads)."""
    app = Flask("batchyard")
    app.config["MAX_CONTENT_LENGTH"] = state.config.max_request_bytes

    @app.get("/ping")
    def ping():
        if state.ready():
            return _json({"status": "Healthy"}, 200)
        reason = {"loading": "model is loading", "failed": "model failed to load",
                  "stopping": "server is shutting down"}.get(state.status, "engine is not running")
        return _error(HTTPError(503, "ServiceUnavailable", reason))

    @app.get("/metrics")
    def metrics():
        return Response(state.metrics.render(), mimetype="text/plain; version=0.0.4")

    @app.post("/invocations")
    def invocations():
        return _serve(state, chat_only=False)

    @app.post("/v1/chat/completions")
    def chat_completions():
        return _serve(state, chat_only=True)

    @app.errorhandler(HTTPError)
    def on_http_error(err: HTTPError):
        return _counted_error(state, err)

    @app.errorhandler(HTTPException)
    def on_werkzeug_error(err: HTTPException):
        if err.code == 413:
            limit = state.config.max_request_bytes
            return _counted_error(state, HTTPError(
                413, "PayloadTooLarge", f"request body exceeds option.max_request_size={limit} "
                "bytes"))
        return _counted_error(state, HTTPError(err.code or 500, type(err).__name__,
                                               err.description or ""))

    @app.errorhandler(Exception)
    def on_unexpected(err: Exception):
        logger.exception("unhandled error in request")
        return _counted_error(state, HTTPError(500, "InternalServerError",
                                               "internal error; see server logs"))

    return app


def _serve(state: ServerState, chat_only: bool) -> Response:
    start = time.monotonic()
    if not state.ready():
        raise HTTPError(503, "ServiceUnavailable", f"not ready: model is {state.status}")
    body = _read_body()
    accept = request.headers.get("Accept", "")
    wants_stream = JSONLINES in accept or SSE in accept
    sse = SSE in accept
    if chat_only or "messages" in body:
        if "messages" not in body:
            raise bad_request("field messages is required")
        chat = parse_chat(body, wants_stream)
        try:
            prompt = state.encode_chat(chat.messages)
        except RequestError as err:
            raise bad_request(str(err)) from err
        handle = _submit(state, prompt, chat.params, chat.stream)
        if chat.stream:
            return _stream(_chat_lines(state, chat, handle), handle, state, sse, sse, start)
        events = _collect(state, handle, start)
        return _json(chat_completion(chat, state.model_name, events, state.token_text), 200)
    gen = parse_generate(body, wants_stream)
    prompts = [state.encode(text) for text in gen.inputs]
    for ids in prompts:  # one invalid input fails the request before anything is submitted
        _validate(state, ids, gen)
    if gen.stream:
        handle = _submit(state, prompts[0], gen.params, stream=True)
        return _stream(_generate_lines(gen, handle), handle, state, sse, False, start)
    handles = _submit_all(state, prompts, gen)
    try:
        results = [generation_dict(_collect(state, h, start), text, gen)
                   for h, text in zip(handles, gen.inputs, strict=True)]
    finally:
        for handle in handles:  # no-op when finished; frees the rest when one input failed
            handle.abort()
    return _json(results if gen.is_list else results[0], 200)


def _read_body() -> dict:
    mimetype = request.mimetype or "application/json"
    raw = request.get_data(cache=False)
    if mimetype == "text/plain":
        return {"inputs": raw.decode("utf-8", errors="replace")}
    if mimetype != "application/json" and not mimetype.endswith("+json"):
        raise HTTPError(415, "UnsupportedMediaType",
                        f"content type {mimetype} is not supported; use application/json")
    try:
        body = json.loads(raw or b"{}", parse_constant=_non_finite, parse_float=_finite)
        json.dumps(body, ensure_ascii=False).encode("utf-8")  # lone surrogates: not text
    except (json.JSONDecodeError, UnicodeDecodeError, UnicodeEncodeError, ValueError) as err:
        raise bad_request(f"malformed JSON body: {_short(str(err))}") from err
    if not isinstance(body, dict):
        raise bad_request("the JSON body must be an object")
    return body


def _non_finite(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number {_short(text)} is out of range")
    return value


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _validate(state: ServerState, ids: list[int], gen: GenerateRequest) -> None:
    try:
        state.validate(ids, gen.params)
    except RequestError as err:
        raise bad_request(str(err)) from err


def _submit(state: ServerState, ids: list[int], params, stream: bool) -> RequestHandle:
    assert state.loop is not None
    deadline = None if stream else time.monotonic() + state.config.predict_timeout
    try:
        return state.loop.submit(ids, params, deadline)
    except RequestError as err:
        raise bad_request(str(err)) from err
    except QueueFullError as err:
        raise HTTPError(503, "QueueFull", f"too many requests in flight: {err}; raise "
                        "job_queue_size or retry later", {"Retry-After": "1"}) from err
    except EngineDeadError as err:
        raise HTTPError(503, "ServiceUnavailable", str(err)) from err


def _submit_all(state: ServerState, prompts: list[list[int]],
                gen: GenerateRequest) -> list[RequestHandle]:
    handles: list[RequestHandle] = []
    try:
        for ids in prompts:
            handles.append(_submit(state, ids, gen.params, stream=False))
    except HTTPError:
        for handle in handles:
            handle.abort()
        raise
    return handles


def _collect(state: ServerState, handle: RequestHandle, start: float) -> list[TokenEvent]:
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


def _generate_lines(gen: GenerateRequest, handle: RequestHandle) -> Lines:
    events: list[TokenEvent] = []
    for event in handle.events():
        events.append(event)
        line: dict = {}
        if event.token_id is not None:
            line["token"] = token_dict(event)
        if event.finished:
            text = "".join(e.text for e in events)
            line["generated_text"] = (gen.inputs[0] + text) if gen.return_full_text else text
            line["details"] = details_dict(events, with_tokens=False)
        yield line, event


def _chat_lines(state: ServerState, chat: ChatRequest, handle: RequestHandle) -> Lines:
    first = True
    for event in handle.events():
        yield chat_chunk(chat, state.model_name, event, first, state.token_text), event
        first = False


def _stream(lines: Lines, handle: RequestHandle, state: ServerState, sse: bool,
            done: bool, start: float) -> Response:
    """Write lines as they come; a client that goes away aborts its request (frees its KV)."""

    def generate() -> Iterator[str]:
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
                yield f"data: {json.dumps(line)}\n\n" if sse else json.dumps(line) + "\n"
            if done:
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


def _json(payload, status: int) -> Response:
    return Response(json.dumps(payload), status=status, mimetype="application/json")


def _counted_error(state: ServerState, err: HTTPError) -> Response:
    """An error answer, counted in the request metrics unless its request already was."""
    if not err.counted:
        state.metrics.requests.labels(str(err.code)).inc()
    return _error(err)


def _error(err: HTTPError) -> Response:
    response = _json(err.body(), err.code)
    response.headers.update(err.headers)
    return response
