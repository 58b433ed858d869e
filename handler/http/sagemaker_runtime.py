"""The SageMaker runtime API on the container itself, so that unchanged boto3 code —
`boto3.client("sagemaker-runtime", endpoint_url="http://localhost:8080")` — can call
`invoke_endpoint` and `invoke_endpoint_with_response_stream` against a local server.

What SageMaker adds around a container is emulated: the answer to invoke_endpoint is the
container's body; the streaming answer is an AWS event stream (application/vnd.amazon.eventstream)
of PayloadPart events; a container error reaches boto3 as ModelError (HTTP 424) carrying the
original status code and body.
"""

from __future__ import annotations

import binascii
import json
import logging
import struct
from collections.abc import Callable, Iterable, Iterator

from flask import Response, request

from handler.http.direct_stream import REFRAMED
from handler.http.schemas import HTTPError

logger = logging.getLogger(__name__)

EVENT_STREAM = "application/vnd.amazon.eventstream"
VARIANT = "AllTraffic"
_STRING = 7  # event-stream header value type


def encode_event(headers: dict[str, str], payload: bytes) -> bytes:
    """One event-stream message: prelude (lengths + CRC), string headers, payload, CRC."""
    encoded = b"".join(
        struct.pack(">B", len(name)) + name.encode() + struct.pack(">BH", _STRING, len(value))
        + value.encode() for name, value in headers.items())
    total = 12 + len(encoded) + len(payload) + 4
    prelude = struct.pack(">II", total, len(encoded))
    message = prelude + struct.pack(">I", binascii.crc32(prelude)) + encoded + payload
    return message + struct.pack(">I", binascii.crc32(message))


def payload_part(data: bytes) -> bytes:
    return encode_event({":event-type": "PayloadPart", ":content-type": "application/octet-stream",
                         ":message-type": "event"}, data)


def model_stream_error(message: str, code: str = "StreamBroken") -> bytes:
    body = json.dumps({"Message": message, "ErrorCode": code}).encode()
    return encode_event({":exception-type": "ModelStreamError",
                         ":content-type": "application/json", ":message-type": "exception"}, body)


def model_error(err: HTTPError) -> Response:
    """How SageMaker reports a container's 4xx/5xx: ModelError, 424, with the original."""
    return _model_error(err.code, json.dumps(err.body()), err.headers)


def model_error_from(response: Response) -> Response:
    """The same for an error answer a custom handler wrote itself (its body kept as is)."""
    return _model_error(response.status_code, response.get_data(as_text=True), {})


def _model_error(code: int, original: str, headers: dict[str, str]) -> Response:
    body = {"ErrorCode": "CLIENT_ERROR_FROM_MODEL" if code < 500 else "SERVER_ERROR_FROM_MODEL",
            "Message": f"Received {'client' if code < 500 else 'server'} error "
                       f"({code}) from primary with message \"{original}\".",
            "OriginalStatusCode": code, "OriginalMessage": original, "LogStreamArn": "local"}
    return Response(json.dumps(body), status=424, mimetype="application/json",
                    headers={"X-Amzn-ErrorType": "ModelError", **headers})


def invoke(serve: Callable[[], Response]) -> Response:
    """invoke_endpoint: the container's answer, whole, with SageMaker's headers."""
    response = serve()
    response.headers["X-Amzn-Invoked-Production-Variant"] = VARIANT
    return response


def invoke_stream(serve: Callable[[], Response]) -> Response:
    """invoke_endpoint_with_response_stream: the container's chunks as PayloadPart events."""
    request.environ[REFRAMED] = True  # every chunk through _events, none written around it
    inner = serve()
    return Response(_events(inner.response, inner.close), mimetype=EVENT_STREAM,
                    headers={"X-Amzn-SageMaker-Content-Type": inner.mimetype or "",
                             "X-Amzn-Invoked-Production-Variant": VARIANT,
                             "X-Accel-Buffering": "no"})


def _events(chunks: Iterable[bytes | str], close: Callable[[], None]) -> Iterator[bytes]:
    try:
        for chunk in chunks:
            data = chunk.encode() if isinstance(chunk, str) else chunk
            if data:
                yield payload_part(data)
    except Exception as err:  # the container broke off mid-stream: say so in the stream
        logger.exception("streaming response failed")
        yield model_stream_error(f"the model stopped streaming: {type(err).__name__}")
    finally:
        close()  # a client that went away aborts the generation behind the stream
