"""Unchanged boto3 sagemaker-runtime code against a local batchyard server."""

from __future__ import annotations

import json

import boto3
import pytest
import requests
from botocore.eventstream import EventStreamBuffer

from handler.http.sagemaker_runtime import encode_event, payload_part
from tests.models_fixtures import build_tiny_model
from tests.server_harness import running_server

PROPS = "option.rolling_batch=paged\noption.max_model_len=512\n"
BODY = {"inputs": "Grüße aus Köln", "parameters": {"max_new_tokens": 9, "ignore_eos": True}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = build_tiny_model(tmp_path_factory.mktemp("smr-model"), max_position_embeddings=512)
    with running_server(tmp_path_factory.mktemp("smr"), model, PROPS) as srv:
        yield srv


@pytest.fixture(scope="module")
def runtime(server):
    # What a user's code does, with only endpoint_url added (credentials are not checked).
    return boto3.client("sagemaker-runtime", endpoint_url=server.url, region_name="us-east-1",
                        aws_access_key_id="local", aws_secret_access_key="local")


def test_event_messages_decode_with_botocore() -> None:
    buffer = EventStreamBuffer()
    buffer.add_data(payload_part(b'{"token": 1}\n') + encode_event({"a": "b"}, b""))
    first, second = list(buffer)
    assert first.headers[":event-type"] == "PayloadPart" and first.payload == b'{"token": 1}\n'
    assert second.headers == {"a": "b"} and second.payload == b""


def test_invoke_endpoint_returns_the_container_answer(server, runtime) -> None:
    r = runtime.invoke_endpoint(EndpointName="my-endpoint", ContentType="application/json",
                                Body=json.dumps(BODY))
    assert r["ContentType"] == "application/json"
    assert r["InvokedProductionVariant"] == "AllTraffic"
    local = requests.post(f"{server.url}/invocations", json=BODY, timeout=30).json()
    assert json.loads(r["Body"].read()) == local


def test_invoke_endpoint_with_response_stream_yields_token_lines(runtime) -> None:
    stream = runtime.invoke_endpoint_with_response_stream(
        EndpointName="my-endpoint", ContentType="application/json",
        Body=json.dumps({**BODY, "stream": True}))
    assert stream["ContentType"] == "application/jsonlines"
    data = b"".join(event["PayloadPart"]["Bytes"] for event in stream["Body"])
    lines = [json.loads(line) for line in data.splitlines() if line]
    assert len(lines) == 9 and all("token" in line for line in lines)
    assert lines[-1]["generated_text"] == "".join(line["token"]["text"] for line in lines)


def test_chat_through_invoke_endpoint(runtime) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "ignore_eos": True}
    r = runtime.invoke_endpoint(EndpointName="e", ContentType="application/json",
                                Body=json.dumps(body))
    answer = json.loads(r["Body"].read())
    assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] == 3


def test_container_errors_reach_boto3_as_model_error(runtime) -> None:
    bad = {"inputs": "x", "parameters": {"top_p": 7}}
    with pytest.raises(runtime.exceptions.ModelError) as caught:
        runtime.invoke_endpoint(EndpointName="e", ContentType="application/json",
                                Body=json.dumps(bad))
    response = caught.value.response
    assert response["ResponseMetadata"]["HTTPStatusCode"] == 424
    assert response["OriginalStatusCode"] == 400
    assert "top_p" in json.loads(response["OriginalMessage"])["message"]
    with pytest.raises(runtime.exceptions.ModelError) as caught:
        runtime.invoke_endpoint_with_response_stream(
            EndpointName="e", ContentType="text/csv", Body=b"a,b")
    assert caught.value.response["OriginalStatusCode"] == 415
