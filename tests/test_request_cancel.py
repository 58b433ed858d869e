"""RequestHandle.cancel_when: a request whose check turns true is aborted, queued or running."""

from __future__ import annotations

import socket
import threading

import pytest

from engine import EngineClient, GenerationRequest, SamplingParams
from tests.engine_harness import make_engine, wait_until
from tests.models_fixtures import build_tiny_model

# Far longer than the 0.1 s between checks could ever cover, so the abort lands mid-way.
LONG = SamplingParams(max_new_tokens=4000, min_new_tokens=4000, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("cancel-model"),
                            max_position_embeddings=4096)


@pytest.fixture
def client(model_dir):
    client = EngineClient(make_engine(model_dir, "continuous", max_num_seqs=1,
                                      max_model_len=4096), max_queued=4)
    client.start()
    yield client
    client.shutdown(grace_seconds=0.0)


def test_a_running_request_is_aborted_once_its_check_is_true(client) -> None:
    gone = threading.Event()
    handle = client.submit(GenerationRequest((5, 6, 7), LONG))
    handle.cancel_when(gone.is_set)
    events = []
    for event in handle.events():
        events.append(event)
        if len(events) == 3:
            gone.set()
    assert handle.cancelled and events[-1].finish_reason == "abort"
    assert events[-1].num_output_tokens < 4000
    wait_until(lambda: client.gauges().kv_blocks_used == 0)


def test_a_queued_request_is_aborted_without_running(client) -> None:
    """max_num_seqs=1: the second request waits behind the first and leaves the queue."""
    first = client.submit(GenerationRequest((5, 6, 7), LONG))
    queued = client.submit(GenerationRequest((8, 9), LONG))
    queued.cancel_when(lambda: True)
    events = list(queued.events())
    assert queued.cancelled and events[-1].finish_reason == "abort"
    assert events[-1].num_output_tokens == 0 and all(e.token_id is None for e in events)
    first.abort()
    assert list(first.events())[-1].finish_reason == "abort"


def test_a_check_that_raises_leaves_the_request_running(client) -> None:
    def broken() -> bool:
        raise OSError("socket gone strange")

    handle = client.submit(GenerationRequest((5, 6, 7), SamplingParams(max_new_tokens=5)))
    handle.cancel_when(broken)
    assert list(handle.events())[-1].finish_reason in ("length", "eos_token")
    assert not handle.cancelled


def test_client_gone_check_on_a_real_socket() -> None:
    """Open and quiet: here. Pipelined bytes waiting: here. Closed by the peer: gone."""
    from handler.http.generation import client_gone_check

    assert client_gone_check({}) is None  # no socket (Flask's test client): nothing to watch
    server, peer = socket.socketpair()
    server.settimeout(30)  # as a server socket may have: the check must not wait on it
    with server, peer:
        gone = client_gone_check({"gunicorn.socket": server})
        assert gone is not None and not gone()
        peer.sendall(b"GET /ping HTTP/1.1\r\n")
        assert not gone() and not gone()  # peeked, not consumed
        assert server.recv(100).startswith(b"GET")
        peer.close()
        assert gone()
