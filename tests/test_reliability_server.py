"""Reliability through a real gunicorn server: parser limits, disconnects, shutdown (issue 21)."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path
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


def test_the_server_parses_requests_with_gunicorns_c_parser() -> None:
    """gunicorn_h1c is pinned and none of gunicorn's flags that rule it out is set: the tests
    above (limits, malformed requests) ran through it, as a served request does."""
    from gunicorn.config import Config
    from gunicorn.http.message import _check_fast_parser

    from handler.http.server import gunicorn_options, http_parser

    cfg = Config()
    for key, value in gunicorn_options("127.0.0.1", 8080, 4, 1.0, 1).items():
        cfg.set(key, value)
    assert _check_fast_parser(cfg) and http_parser() == "gunicorn_h1c (C)"


def send_and_hang_up(url: str, body: dict, path: str = "/invocations") -> socket.socket:
    """Send a whole POST and return the open socket (the caller closes it: a disconnect)."""
    address = urlparse(url)
    data = json.dumps(body).encode()
    sock = socket.create_connection((address.hostname, address.port), timeout=30)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def wait_for(condition, what: str, timeout: float = 30) -> None:
    """Liveness only: a generous bound, not a timing assertion."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def worker_fds(server) -> int:
    """Open descriptors of the server's one gunicorn worker (Linux /proc)."""
    master = server.process.pid
    (worker,) = Path(f"/proc/{master}/task/{master}/children").read_text().split()
    return len(os.listdir(f"/proc/{worker}/fd"))


def test_clients_that_keep_their_socket_open_after_the_answer_block_nothing(server) -> None:
    """After a `Connection: close` answer gunicorn lingers until the client closes too (up to
    2 s). On its main thread that blocked every accept and close: here the 2nd answer came
    after 2 s, the 4th after 6 s, and a /ping behind them after 8 s."""
    body = json.dumps({"inputs": "x", "parameters": {"max_new_tokens": 2}}).encode()
    address = urlparse(server.url)
    baseline = worker_fds(server)
    started, held = time.monotonic(), []
    try:
        for _ in range(4):
            sock = socket.create_connection((address.hostname, address.port), timeout=30)
            sock.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                         b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                         % len(body) + body)
            answer = b"".join(iter(lambda s=sock: s.recv(65536), b""))  # until the server's FIN
            assert answer.startswith(b"HTTP/1.1 200") and b"generated_text" in answer
            held.append(sock)  # open: the client does not close its end
        assert requests.get(f"{server.url}/ping", timeout=10).status_code == 200
        assert time.monotonic() - started < 4, "the answers waited for the lingering closes"
        # The server still closes them once the linger is over.
        wait_for(lambda: worker_fds(server) <= baseline, "the lingering sockets are closed")
    finally:
        for sock in held:
            sock.close()


LONG = {"inputs": "long", "parameters": {"max_new_tokens": 4000, "ignore_eos": True}}
DISCONNECTS = 'batchyard_aborted_requests_total{reason="client_disconnect"}'


@pytest.mark.parametrize("path", ["/invocations", "/v1/chat/completions",
                                  "/endpoints/x/invocations"])
def test_a_non_streaming_client_that_hangs_up_aborts_its_request(server, path) -> None:
    body = LONG if "chat" not in path else {
        "messages": [{"role": "user", "content": "long"}], "max_tokens": 4000,
        "ignore_eos": True}
    before, tokens = server.metric(DISCONNECTS), server.metric("batchyard_generation_tokens")
    sock = send_and_hang_up(server.url, body, path)
    wait_for(lambda: server.metric("batchyard_running_sequences") == 1, "the request runs")
    sock.close()
    wait_for(lambda: server.metric(DISCONNECTS) == before + 1, "the request is aborted")
    wait_for(lambda: server.metric("batchyard_kv_blocks_used") == 0, "its KV is freed")
    assert server.metric("batchyard_running_sequences") == 0
    assert server.metric('batchyard_requests_total{status="499"}') >= 1
    assert server.metric("batchyard_generation_tokens") - tokens < 4000, "it ran to the end"


def test_a_queued_request_whose_client_left_is_never_scheduled(server) -> None:
    """4 streams fill max_rolling_batch_size=4 and keep running; a 5th request waits, its client
    hangs up, and it leaves the queue while the 4 still run: it never got a slot."""
    before = server.metric(DISCONNECTS)
    streams = [requests.post(f"{server.url}/invocations", json={**LONG, "stream": True},
                             stream=True, timeout=60) for _ in range(4)]
    lines = [r.iter_lines() for r in streams]  # held: a dropped iterator closes its socket
    try:
        for line in lines:
            next(line)
        waiting = send_and_hang_up(server.url, LONG)
        wait_for(lambda: server.metric("batchyard_queue_depth") == 1, "the 5th request waits")
        waiting.close()
        wait_for(lambda: server.metric(DISCONNECTS) == before + 1, "the waiting one is aborted")
        assert server.metric("batchyard_queue_depth") == 0
        assert server.metric("batchyard_running_sequences") == 4
    finally:
        for r in streams:
            r.close()
    wait_for(lambda: server.metric("batchyard_kv_blocks_used") == 0, "every block is free")
    assert server.metric(DISCONNECTS) == before + 5


def test_sigterm_answers_503_while_draining_and_cuts_off_with_an_error(model_dir,
                                                                        tmp_path) -> None:
    """option.drain_timeout=1: after SIGTERM /ping and new requests get a prompt 503 (not a
    hang or a reset); a stream still running when the drain ends gets a final 503 error line;
    the server exits 0."""
    props = CONTINUOUS + "option.drain_timeout=1\n"
    with running_server(tmp_path, model_dir, props) as srv:
        stream = requests.post(f"{srv.url}/invocations", json={**LONG, "stream": True},
                               stream=True, timeout=60)
        lines = stream.iter_lines()
        next(lines)
        srv.process.send_signal(signal.SIGTERM)
        wait_for(lambda: requests.get(f"{srv.url}/ping", timeout=10).status_code == 503,
                 "/ping turns 503")
        assert "shutting down" in requests.get(f"{srv.url}/ping", timeout=10).json()["message"]
        refused = requests.post(f"{srv.url}/invocations", json={"inputs": "x"}, timeout=10)
        assert refused.status_code == 503 and refused.json()["type"] == "ServiceUnavailable"
        last = json.loads([line for line in lines if line][-1])
        assert last["code"] == 503 and "shutting down" in last["message"]
        assert last["details"]["finish_reason"] == "error"
        assert srv.process.wait(timeout=60) == 0
        assert "aborting 1 requests still in flight after 1 s" in srv.log()
