"""A stream written by the engine's output thread (handler/http/direct_stream.py): each step's
lines go out from the thread that delivers the events, in one chunk framed as gunicorn frames
it, while the request thread waits; a client that does not keep up, a client that is gone, a
failing line maker and a stopped output thread each end that arrangement without losing or
reordering a byte, and without ever blocking the delivering thread."""

from __future__ import annotations

import json
import socket
import ssl
import threading
from types import SimpleNamespace

import pytest
from flask import Flask
from gunicorn import util

from engine.outputs import TokenEvent
from engine.serving.loop import EngineLoop, RequestHandle
from handler.http.direct_stream import REFRAMED, DirectWriter, chunk, direct_socket
from handler.http.generation import stream_response

WAIT = 10  # seconds a test waits for a thread before calling it stuck


def _event(i: int, last: bool = False, text: str | None = None) -> TokenEvent:
    return TokenEvent("r", 10 + i, f"t{i}" if text is None else text, -0.5, 3, i + 1,
                      "length" if last else None)


class _Loop:
    """The real EngineLoop's delivery (_dispatch) around one request, with no core."""

    def __init__(self) -> None:
        self.sent: list = []  # what the loop told the core
        core = SimpleNamespace(initial_gauges=None, send=self.sent.append)
        self.loop = EngineLoop(core, SimpleNamespace(backend_tokenizer=None), 4, 4)
        self.delivering = True
        self.loop.is_delivering = lambda: self.delivering
        self.handle = RequestHandle(self.loop, "r", 3)
        self.loop._handles["r"] = self.handle

    def deliver(self, *events: TokenEvent) -> None:
        """One step's events, delivered on a thread that must not block."""
        worker = threading.Thread(target=self.loop._dispatch, args=(list(events),), daemon=True)
        worker.start()
        worker.join(WAIT)
        assert not worker.is_alive(), "delivering the events blocked"


def _line_of(made_on: list[str], fail_at: int | None = None):
    """A route's line maker, noting the thread that made each line."""
    def line_of(event: TokenEvent) -> dict:
        if len(made_on) == fail_at:
            raise RuntimeError("a line maker failed")
        made_on.append(threading.current_thread().name)
        return {"id": event.token_id, "text": event.text}
    return line_of


def _text(line: dict, event: TokenEvent) -> str:
    return f"{line['id']}:{line['text']}\n"


class _Request:
    """A request thread running DirectWriter.write(), as stream_response does."""

    def __init__(self, loop: _Loop, sock: socket.socket, fail_at: int | None = None) -> None:
        self.made_on: list[str] = []
        self.line_of = _line_of(self.made_on, fail_at)
        self.handle = loop.handle
        self.writer = DirectWriter(loop.handle, sock, self.line_of, _text)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="request", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.writer.write()
        except BaseException as err:
            self.error = err

    def join(self) -> None:
        self.thread.join(WAIT)
        assert not self.thread.is_alive(), "the request thread is still waiting"

    def rest(self) -> list[tuple[dict, TokenEvent]]:
        """The lines left to the request thread: those of the events the writer did not take."""
        return [(self.line_of(event), event) for event in self.handle.events()]


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        part = sock.recv(size - len(data))
        assert part, "the stream ended early"
        data += part
    return data


def _tcp_pair(buffer: int | None = None) -> tuple[socket.socket, socket.socket]:
    """A server-side and a client-side socket over loopback TCP, as gunicorn has them."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.socket()
        if buffer is not None:  # fixed small buffers: no autotuning, the socket fills
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer)
        client.connect(listener.getsockname())
        server, _ = listener.accept()
    if buffer is not None:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer)
    client.settimeout(WAIT)
    return server, client


@pytest.fixture
def pair():
    server, client = _tcp_pair()
    yield server, client
    server.close()
    client.close()


def _until_listening(loop: _Loop) -> None:
    for _ in range(WAIT * 100):
        if loop.handle._listener is not None:
            return
        threading.Event().wait(0.01)
    raise AssertionError("the writer never listened")


def test_each_step_goes_out_in_one_chunk_from_the_delivering_thread(pair) -> None:
    server, client = pair
    loop = _Loop()
    request = _Request(loop, server)
    _until_listening(loop)
    loop.deliver(_event(0))
    assert _read_exactly(client, len(chunk(b"10:t0\n"))) == chunk(b"10:t0\n")
    loop.deliver(_event(1), _event(2))  # one step, two events: one chunk
    step = chunk(b"11:t1\n12:t2\n")
    assert _read_exactly(client, len(step)) == step
    loop.deliver(_event(3, last=True))
    request.join()
    assert request.error is None and request.writer.ended
    assert _read_exactly(client, len(chunk(b"13:t3\n"))) == chunk(b"13:t3\n")
    assert request.made_on and "request" not in request.made_on
    assert loop.handle._listener is None


def test_events_queued_before_it_listens_go_out_at_once(pair) -> None:
    server, client = pair
    loop = _Loop()
    loop.handle._events.put(_event(0))  # came while the response's headers went out
    loop.handle._events.put(_event(1, last=True))
    request = _Request(loop, server)
    request.join()
    assert request.writer.ended and request.made_on == ["request", "request"]
    both = chunk(b"10:t0\n11:t1\n")
    assert _read_exactly(client, len(both)) == both


def test_chunks_are_framed_as_gunicorn_frames_them(pair) -> None:
    server, client = pair
    data = "Grüße 東京\n".encode() * 300  # over 255 bytes: a multi-digit hex length
    util.write_chunk(server, data)
    assert _read_exactly(client, len(chunk(data))) == chunk(data)


def test_a_client_that_falls_behind_gets_the_rest_from_its_request_thread() -> None:
    """Its socket full, the delivering thread hands the stream back rather than wait; nothing
    is lost or reordered once the client reads again."""
    server, client = _tcp_pair(buffer=4096)
    try:
        loop = _Loop()
        request = _Request(loop, server)
        _until_listening(loop)
        big = "x" * 500_000
        loop.deliver(_event(0, text=big))  # more than the socket holds: handed back at once
        assert loop.handle._listener is None
        expected = chunk(f"10:{big}\n".encode()) + b"11:t1\n"
        received: list[bytes] = []
        reader = threading.Thread(target=lambda: received.append(
            _read_exactly(client, len(expected))))
        reader.start()  # the request thread writes the rest of the chunk as the client reads
        request.join()
        assert request.error is None and not request.writer.ended
        loop.deliver(_event(1, last=True))  # queued for the request thread now
        rest = [_text(line, event) for line, event in request.rest()]
        assert rest == ["11:t1\n"]
        assert request.made_on[-1] == "MainThread" and "request" not in request.made_on
        server.sendall(rest[0].encode())
        reader.join(WAIT)
        assert received == [expected]
    finally:
        server.close()
        client.close()


def test_a_gone_client_is_the_request_threads_error(pair) -> None:
    server, client = pair
    loop = _Loop()
    request = _Request(loop, server)
    _until_listening(loop)
    client.close()
    for i in range(100):  # a first write to a closed peer may still succeed: TCP learns later
        loop.deliver(_event(i))
        request.thread.join(0.05)
        if not request.thread.is_alive():
            break
    request.join()
    assert isinstance(request.error, OSError)
    assert not request.writer.ended and loop.handle._listener is None


def test_a_client_gone_while_no_token_comes_is_aborted(pair) -> None:
    """Preempted or stalled, a stream gets no events: the waiting request thread runs the
    client check itself, and the abort's final event ends the stream."""
    server, client = pair
    loop = _Loop()
    gone = threading.Event()
    loop.handle.cancel_when(gone.is_set)
    request = _Request(loop, server)
    _until_listening(loop)
    gone.set()
    for _ in range(WAIT * 100):
        if loop.sent:
            break
        threading.Event().wait(0.01)
    assert [type(m).__name__ for m in loop.sent] == ["AbortRequest"] and loop.handle.cancelled
    loop.deliver(TokenEvent("r", None, "", None, 3, 0, "abort"))
    request.join()
    assert request.writer.ended and len(request.made_on) == 1


def test_a_failing_line_maker_raises_after_the_lines_made_before_it(pair) -> None:
    server, client = pair
    loop = _Loop()
    request = _Request(loop, server, fail_at=1)
    _until_listening(loop)
    loop.deliver(_event(0), _event(1))
    request.join()
    assert isinstance(request.error, RuntimeError)
    assert _read_exactly(client, len(chunk(b"10:t0\n"))) == chunk(b"10:t0\n")


def test_a_wait_cut_short_by_an_exception_lets_go_of_the_stream(pair) -> None:
    server, _ = pair
    loop = _Loop()

    def broken() -> None:
        raise RuntimeError("the check broke")
    loop.handle.check_cancel = broken
    request = _Request(loop, server)
    request.join()
    assert isinstance(request.error, RuntimeError) and loop.handle._listener is None


def test_when_the_output_thread_stops_the_request_thread_takes_over(pair) -> None:
    server, _ = pair
    loop = _Loop()
    request = _Request(loop, server)
    _until_listening(loop)
    loop.delivering = False
    request.join()
    assert request.error is None and not request.writer.ended
    last = request.rest()[-1][1]  # the handle's own end: the loop stopped
    assert last.finish_reason == "error" and "stopped" in last.error


def test_a_late_delivery_after_the_hand_back_writes_nothing(pair) -> None:
    """A listener the loop picked up just before the request thread took over is a no-op."""
    server, client = pair
    loop = _Loop()
    request = _Request(loop, server)
    _until_listening(loop)
    listener = loop.handle._listener
    loop.delivering = False
    request.join()
    loop.handle._events.put(_event(0))
    listener()
    assert loop.handle.has_queued_events() and request.made_on == []
    client.setblocking(False)
    with pytest.raises(BlockingIOError):
        client.recv(1)


def test_which_responses_may_be_written_around_gunicorn(pair) -> None:
    server, _ = pair
    ok = {"gunicorn.socket": server, "SERVER_PROTOCOL": "HTTP/1.1", "REQUEST_METHOD": "POST"}
    assert direct_socket(ok) is server
    assert direct_socket({**ok, "SERVER_PROTOCOL": "HTTP/1.0"}) is None  # not chunked
    assert direct_socket({**ok, "REQUEST_METHOD": "HEAD"}) is None
    assert direct_socket({**ok, REFRAMED: True}) is None  # SageMaker's event stream wraps it
    assert direct_socket({k: v for k, v in ok.items() if k != "gunicorn.socket"}) is None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # what gunicorn's certfile gives
    tls = context.wrap_socket(socket.socket(), server_side=True, do_handshake_on_connect=False)
    try:
        assert direct_socket({**ok, "gunicorn.socket": tls}) is None
    finally:
        tls.close()
    server.settimeout(5)  # send() would wait
    assert direct_socket(ok) is None


def test_stream_response_hands_a_full_socket_back_to_its_request_thread() -> None:
    """Through stream_response as a route runs it: the first line and everything after the
    hand-back go out through the WSGI body (gunicorn), the steps between from the delivering
    thread straight to the socket; the metrics name the stream handed_back."""
    server, client = _tcp_pair(buffer=4096)
    loop = _Loop()
    writers: list[str] = []
    metrics = SimpleNamespace(on_abort=lambda *a: None, on_request=lambda *a: None,
                              on_stream=writers.append)
    made_on: list[str] = []
    big = "x" * 500_000
    environ = {"gunicorn.socket": server, "SERVER_PROTOCOL": "HTTP/1.1"}
    try:
        with Flask(__name__).test_request_context("/", method="POST",
                                                  environ_overrides=environ):
            response = stream_response(_line_of(made_on), loop.handle,
                                       SimpleNamespace(metrics=metrics), sse=False,
                                       done_line=False, start=0.0, coalesce=True, direct=True)
        loop.handle._events.put(_event(0))
        body: list[str] = []
        request = threading.Thread(target=lambda: body.extend(response.response), daemon=True)
        request.start()
        _until_listening(loop)  # the first line went out through the body
        loop.deliver(_event(1, text=big))  # does not fit: handed back
        direct = chunk(json.dumps({"id": 11, "text": big}).encode() + b"\n")
        assert _read_exactly(client, len(direct)) == direct
        loop.deliver(_event(2, last=True))
        request.join(WAIT)
        assert not request.is_alive()
        assert [json.loads(line)["id"] for line in "".join(body).splitlines()] == [10, 12]
        assert writers == ["handed_back"]
    finally:
        server.close()
        client.close()
