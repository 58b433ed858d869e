"""invoke: one request through sagemaker-runtime, or a token stream printed as it arrives."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from typing import Any

from botocore.exceptions import ClientError

from deploy.aws import Aws, DeployError, error_code, error_message, translate
from deploy.jsonlines import JsonLinesSplitter, StreamLineError

logger = logging.getLogger(__name__)

READ_TIMEOUT = 70  # SageMaker answers within 60 s; clients should wait a little longer


def request_body(prompt: str, parameters: str | None, *, stream: bool) -> bytes:
    body: dict[str, Any] = {"inputs": prompt}
    if parameters:
        try:
            params = json.loads(parameters)
        except json.JSONDecodeError as err:
            raise DeployError(f"--parameters is not JSON: {err}") from err
        if not isinstance(params, dict):
            raise DeployError("--parameters must be a JSON object, e.g. '{\"max_new_tokens\": 64}'")
        body["parameters"] = params
    if stream:
        body["stream"] = True
    return json.dumps(body).encode("utf-8")


def invoke(aws: Aws, name: str, prompt: str, parameters: str | None = None,
           endpoint_url: str | None = None) -> str:
    """The generated text (or the raw body when it is not the usual JSON shape)."""
    runtime = aws.client("sagemaker-runtime", endpoint_url=endpoint_url,
                         read_timeout=READ_TIMEOUT, allow_unsigned=True)
    try:
        response = runtime.invoke_endpoint(EndpointName=name, ContentType="application/json",
                                           Accept="application/json",
                                           Body=request_body(prompt, parameters, stream=False))
    except ClientError as err:
        raise _model_error(err, name) from err
    raw = response["Body"].read().decode("utf-8", errors="replace")
    try:
        answer = json.loads(raw)
    except json.JSONDecodeError:
        return raw
    if isinstance(answer, dict) and "generated_text" in answer:
        return str(answer["generated_text"])
    if isinstance(answer, list) and all(isinstance(a, dict) and "generated_text" in a
                                        for a in answer):
        return "\n".join(str(a["generated_text"]) for a in answer)
    return raw


def invoke_stream(aws: Aws, name: str, prompt: str, parameters: str | None = None,
                  endpoint_url: str | None = None,
                  write: Callable[[str], None] = print) -> dict[str, Any]:
    """Write each token's text as it arrives; returns the last line (generated_text, details)."""
    runtime = aws.client("sagemaker-runtime", endpoint_url=endpoint_url,
                         read_timeout=READ_TIMEOUT, allow_unsigned=True)
    try:
        response = runtime.invoke_endpoint_with_response_stream(
            EndpointName=name, ContentType="application/json", Accept="application/jsonlines",
            Body=request_body(prompt, parameters, stream=True))
        return print_tokens(response["Body"], write)
    except ClientError as err:
        raise _model_error(err, name) from err


def print_tokens(events: Iterable[dict[str, Any]], write: Callable[[str], None]
                 ) -> dict[str, Any]:
    try:
        return _print_lines(events, write)
    except StreamLineError as err:  # a line that is not JSON
        raise DeployError(str(err)) from err


def _print_lines(events: Iterable[dict[str, Any]], write: Callable[[str], None]
                 ) -> dict[str, Any]:
    splitter = JsonLinesSplitter()
    last: dict[str, Any] = {}
    for event in events:
        if "PayloadPart" not in event:
            error = event.get("ModelStreamError") or event.get("InternalStreamFailure") or event
            raise DeployError(f"the stream failed: {error}")
        for obj in splitter.feed(event["PayloadPart"].get("Bytes", b"")):
            last = _show(obj, write)
    for obj in splitter.close():
        last = _show(obj, write)
    return last


def _show(obj: dict[str, Any], write: Callable[[str], None]) -> dict[str, Any]:
    token = obj.get("token")
    if isinstance(token, dict):
        write(str(token.get("text", "")))
    if obj.get("code") or obj.get("finish_reason") == "error":
        raise DeployError(f"the model stopped with an error: {obj.get('message', obj)}")
    return obj


def _model_error(err: ClientError, name: str) -> DeployError:
    """ModelError carries the container's own status and message; say those."""
    if error_code(err) == "ModelError":
        fields = {**err.response.get("Error", {}), **err.response}
        status = fields.get("OriginalStatusCode", "?")
        message = " ".join(str(fields.get("OriginalMessage") or error_message(err)).split())
        return DeployError(f"endpoint {name}: the container answered {status}: {message}")
    return translate(err, f"invoking endpoint {name}")
