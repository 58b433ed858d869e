"""Reliability through a real gunicorn server: parser limits, disconnects, shutdown (issue 21)."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlparse

import pytest
import requests

from tests.models_fixtures import build_tiny_model
from tests.server_harness import running_server

pytestmark = pytest.mark.slow

CONTINUOUS = ("option.rolling_batch=scheduler\noption.max_rolling_batch_size=4\n"
              "option.max_model_len=4096\njob_queue_size=8\n")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("reliability-model"),
                            max_position_embeddings=4096)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("srv"), model_dir, CONTINUOUS) as srv:
        yield srv


def raw_exchange(url: str, request: bytes) -> bytes:
    """Send raw bytes, read the whole answer (the server closes after an error)."""
    address = urlparse(url)
    with socket.create_connection((address.hostname, address.port), timeout=30) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize(("headers", "code", "words"), [
    ({"X-Big": "a" * 9000}, 431, "8190 bytes"),
    ({f"X-H{i}": "1" for i in range(150)}, 431, "100 fields"),
])
def test_oversized_headers_get_a_json_error(server, headers, code, words) -> None:
    r = requests.post(f"{server.url}/invocations", json={"inputs": "x"}, headers=headers,
                      timeout=30)
    assert r.status_code == code and r.headers["Content-Type"] == "application/json"
    assert r.json()["code"] == code and words in r.json()["message"]
    assert requests.get(f"{server.url}/ping", timeout=10).status_code == 200


def test_a_malformed_request_line_gets_a_json_400(server) -> None:
    answer = raw_exchange(server.url, b"POST /invocations HTTP/9.9\r\nHost: x\r\n\r\n")
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
    assert json.loads(body)["type"] == "BadRequest" and b"<html>" not in answer
