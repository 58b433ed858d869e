"""Flask app: GET /ping, POST /invocations, OpenAI's /v1/chat/completions, /v1/completions and
/v1/models, GET /metrics."""

from __future__ import annotations

import json
import logging
import time

from flask import Flask, Response, request
from werkzeug.exceptions import HTTPException

from handler.http import sagemaker_runtime
from handler.http.adapter_routes import add_adapter_routes
from handler.http.chat_route import serve_chat
from handler.http.completions import models, openai_error
from handler.http.generate_route import serve_generate
from handler.http.generation import CLIENT_GONE, JSONLINES, SSE, client_gone_check
from handler.http.openai_routes import serve_completions
from handler.http.schemas import HTTPError, bad_request
from handler.http.state import ServerState
from handler.lmi.bridge import request_content, request_properties, row_response
from handler.lmi.runner import CallAborted, RunnerFull

logger = logging.getLogger(__name__)


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

    @app.post("/v1/completions")
    def completions():
        return _serve(state, chat_only=False, completions=True)

    @app.get("/v1/models")
    def list_models():
        adapters = state.engine.adapters() if state.ready() and state.runner is None else []
        return _json(models(state.model_name, state.started, adapters), 200)

    add_adapter_routes(app, state)  # DJL's, SageMaker's and vLLM's adapter registration

    # The SageMaker runtime paths: boto3's invoke_endpoint(_with_response_stream) with
    # endpoint_url pointing at this server. Any endpoint name is this server's model.
    @app.post("/endpoints/<name>/invocations")
    def sagemaker_invoke(name: str):
        return _as_model_error(state, lambda: sagemaker_runtime.invoke(
            lambda: _serve(state, chat_only=False)))

    @app.post("/endpoints/<name>/invocations-response-stream")
    def sagemaker_invoke_stream(name: str):
        accept = request.headers.get("X-Amzn-SageMaker-Accept", "")
        return _as_model_error(state, lambda: sagemaker_runtime.invoke_stream(
            lambda: _serve(state, chat_only=False, accept=accept)))

    @app.errorhandler(HTTPError)
    def on_http_error(err: HTTPError):
        return _counted_error(state, err)

    @app.errorhandler(HTTPException)
    def on_werkzeug_error(err: HTTPException):
        return _counted_error(state, _from_werkzeug(state, err))

    @app.errorhandler(Exception)
    def on_unexpected(err: Exception):
        logger.exception("unhandled error in request")
        return _counted_error(state, HTTPError(500, "InternalServerError",
                                               "internal error; see server logs"))

    return app


def _as_model_error(state: ServerState, call) -> Response:
    """Container errors as SageMaker reports them to boto3 (ModelError, 424)."""
    try:
        response = call()
    except (HTTPError, HTTPException) as err:
        error = err if isinstance(err, HTTPError) else _from_werkzeug(state, err)
        _count(state, error)
        return sagemaker_runtime.model_error(error)
    except Exception:  # as SageMaker reports a container's 500: ModelError, sanitized
        logger.exception("unhandled error in request")
        error = HTTPError(500, "InternalServerError", "internal error; see server logs")
        _count(state, error)
        return sagemaker_runtime.model_error(error)
    if response.status_code >= 400:  # a custom handler's own error answer
        return sagemaker_runtime.model_error_from(response)
    return response


def _serve(state: ServerState, *, chat_only: bool, accept: str | None = None,
           completions: bool = False) -> Response:
    start = time.monotonic()
    if not state.ready():
        raise HTTPError(503, "ServiceUnavailable", f"not ready: model is {state.status}")
    if state.runner is not None:
        return serve_custom(state)
    body = state.formatters.request(_read_body())  # option.input_formatter
    accept = request.headers.get("Accept", "") if accept is None else accept
    if completions or (not chat_only and "prompt" in body
                       and not {"inputs", "messages"} & set(body)):  # OpenAI's completions
        return serve_completions(state, body, start)
    if chat_only:  # OpenAI's route: the body says whether to stream, and a stream is SSE
        return serve_chat(state, body, wants_stream=False, sse=True, start=start)
    if "messages" in body:
        return serve_chat(state, body, wants_stream=JSONLINES in accept or SSE in accept,
                          sse=SSE in accept, start=start)
    return serve_generate(state, body, accept, start)


def serve_custom(state: ServerState) -> Response:
    """The model folder's handler answers, as DJL Serving would run it. A call whose client
    leaves before it starts is dropped (499); one the drain cuts off answers 503."""
    assert state.runner is not None
    try:
        row = state.runner.call(request_properties(request), request_content(request),
                                timeout=state.config.predict_timeout,
                                gone=client_gone_check(request.environ))
    except RunnerFull as err:
        raise HTTPError(503, "QueueFull", f"too many requests in flight: {err}; raise "
                        "job_queue_size or retry later", {"Retry-After": "1"}) from err
    except CallAborted as err:
        state.metrics.on_abort(err.reason)
        if err.reason == "shutdown":
            raise HTTPError(503, "ServiceUnavailable",
                            "request aborted: the server is shutting down") from err
        raise HTTPError(CLIENT_GONE.code, CLIENT_GONE.type, CLIENT_GONE.message) from err
    if row is None:
        raise HTTPError(504, "TimeoutError", "request exceeded option.predict_timeout")
    response = row_response(row)
    state.metrics.requests.labels(str(response.status_code)).inc()
    return response


def _read_body() -> dict:
    mimetype = request.mimetype or "application/json"
    raw = request.get_data(cache=False)
    if mimetype == "text/plain":
        try:
            return {"inputs": raw.decode("utf-8")}
        except UnicodeDecodeError as err:  # replacement characters would change the prompt
            raise bad_request(f"the text/plain body is not valid UTF-8 (byte {err.start}); "
                              "send UTF-8 text") from err
    if mimetype != "application/json" and not mimetype.endswith("+json"):
        raise HTTPError(415, "UnsupportedMediaType",
                        f"content type {mimetype} is not supported; use application/json")
    try:
        body = json.loads(raw or b"{}", parse_constant=_non_finite, parse_float=_finite)
        # a lone surrogate is not text; only a \u escape or a surrogate's own UTF-8 bytes
        # (0xED ..., which json.loads decodes with surrogatepass) can spell one
        if b"\\u" in raw or b"\xed" in raw:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
    except (json.JSONDecodeError, UnicodeDecodeError, UnicodeEncodeError, ValueError) as err:
        raise bad_request(f"malformed JSON body: {_short(str(err))}") from err
    except RecursionError as err:  # the parser recurses once per level of [ or {
        raise bad_request("malformed JSON body: arrays/objects nested too deeply for the "
                          "parser (keep nesting well under 1000 levels)") from err
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


def _json(payload, status: int) -> Response:
    return Response(json.dumps(payload), status=status, mimetype="application/json")


def _from_werkzeug(state: ServerState, err: HTTPException) -> HTTPError:
    if err.code == 413:
        limit = state.config.max_request_bytes
        return HTTPError(413, "PayloadTooLarge",
                         f"request body exceeds option.max_request_size={limit} bytes")
    return HTTPError(err.code or 500, type(err).__name__, err.description or "")


def _count(state: ServerState, err: HTTPError) -> None:
    """Count an error answer in the request metrics unless its request already was."""
    if not err.counted:
        state.metrics.requests.labels(str(err.code)).inc()


def _counted_error(state: ServerState, err: HTTPError) -> Response:
    _count(state, err)
    return _error(err)


def _error(err: HTTPError) -> Response:
    """Our error shape; on OpenAI's /v1 routes, OpenAI's."""
    payload = openai_error(err) if request.path.startswith("/v1/") else err.body()
    response = _json(payload, err.code)
    response.headers.update(err.headers)
    return response
