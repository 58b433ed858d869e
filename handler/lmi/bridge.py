"""HTTP ⇄ djl_python, as DJL Serving maps them: headers (and split custom attributes) become
Input properties and the body its "data"; an Output's code, message, properties (headers,
content-type among them), body or stream become the answer. A handler that raises answers 424
with a JSON error (507 when it ran out of memory); None answers 204."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator

from flask import Request, Response

from handler.lmi.rows import Row
from handler.lmi.runner import CallAborted

logger = logging.getLogger(__name__)

CUSTOM_ATTRIBUTES = "x-amzn-sagemaker-custom-attributes"
_HOP_BY_HOP = {"content-length", "transfer-encoding", "connection", "content-type"}


def request_properties(request: Request) -> dict[str, str]:
    """Header names in lower case (DJL's get_property ignores case); custom attributes
    `k=v;k2=v2` also one property each; a requestId."""
    properties = {name.lower(): value for name, value in request.headers.items()}
    for pair in properties.get(CUSTOM_ATTRIBUTES, "").split(";"):
        key, sep, value = pair.partition("=")
        if sep and key.strip():
            properties.setdefault(key.strip(), value.strip())
    properties["requestId"] = (properties.get("x-amzn-sagemaker-inference-id")
                               or uuid.uuid4().hex)
    return properties


def request_content(request: Request) -> list[tuple[str, bytes]]:
    """The body under "data", then each query parameter, as DJL adds them."""
    content = [("data", request.get_data(cache=False))]
    content += [(key, value.encode("utf-8")) for key, value in request.args.items()]
    return content


def row_response(row: Row) -> Response:
    if row.error is not None:
        return error_response(row.error)
    if row.empty:
        return Response(status=204)
    content_type = next((v for k, v in row.properties.items() if k.lower() == "content-type"),
                        None)
    headers = {k: v for k, v in row.properties.items() if k.lower() not in _HOP_BY_HOP}
    if row.stream is not None:
        body: Iterator[bytes] | bytes | str = _stream(row)
    else:
        body = dict(row.items).get("data", row.items[0][1] if row.items else b"")
        if row.code >= 300 and not body:
            body = json.dumps({"code": row.code, "message": row.message})
            content_type = content_type or "application/json"
    response = Response(body, status=row.code, headers=headers,
                        content_type=content_type or _guess(body))
    if row.finalize is not None and row.stream is None:  # a stream runs it when it ends
        response.call_on_close(_safe(row.finalize))
    close = getattr(row.stream, "close", None)
    if callable(close):  # also when the stream was never read (its drain accounting)
        response.call_on_close(_safe(close))
    return response


def error_response(err: BaseException) -> Response:
    """424 with the exception's message (no trace); 507 for an out-of-memory error."""
    code = 507 if is_out_of_memory(err) else 424
    message = "insufficient memory" if code == 507 else "invoke handler failure"
    body = {"code": code, "type": type(err).__name__, "message": message, "error": str(err)}
    return Response(json.dumps(body), status=code, content_type="application/json")


def is_out_of_memory(err: BaseException) -> bool:
    return (isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError"
            or "out of memory" in str(err).lower())


def _stream(row: Row) -> Iterator[bytes]:
    """Chunked transfer: each item formatted (str/bytes kept, anything else one JSON line);
    an error mid-stream ends it with a JSON error line, the drain's end with a 503 one."""
    formatter = row.stream_formatter
    assert row.stream is not None  # row_response streams only a row with a stream
    try:
        for item in row.stream:
            yield _as_bytes(formatter(item) if formatter is not None else item)
    except CallAborted:
        yield _as_bytes({"code": 503, "type": "ServiceUnavailable",
                         "message": "request aborted: the server is shutting down"})
    except Exception as err:  # the status line has gone out: report in the body
        logger.warning("handler stream raised %s: %s", type(err).__name__, err)
        yield _as_bytes({"code": 424, "message": "invoke handler failure", "error": str(err)})
    finally:
        if row.finalize is not None:
            _safe(row.finalize)()


def _as_bytes(item: object) -> bytes:
    if isinstance(item, bytes | bytearray):
        return bytes(item)
    if isinstance(item, str):
        return item.encode("utf-8")
    return (json.dumps(item) + "\n").encode("utf-8")


def _guess(body: object) -> str:
    """No content-type property: JSON when the body parses as JSON, else octet-stream."""
    if not isinstance(body, bytes | str):
        return "application/octet-stream"
    try:
        json.loads(body or b"x")
    except ValueError:
        return "application/octet-stream"
    return "application/json"


def _safe(function):
    def run() -> None:
        try:
            function()
        except Exception:
            logger.exception("finalize function failed")
    return run
