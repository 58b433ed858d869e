"""Streams written by the engine's output thread instead of their request threads.

Served the usual way, every token of every stream wakes that stream's request thread, which
formats one line and writes it through werkzeug and gunicorn: with 32 streams, 32 thread
switches and GIL hand-offs per engine step, and on a small host more CPU per token in the
serving process than in the engine core. Here the output thread, which has just turned the
step's token ids into text, also formats each stream's lines and sends them, one chunk per
stream per step, without blocking (MSG_DONTWAIT). Its request thread sleeps until the stream
ends. A client that does not keep up (its socket buffer full) gets the rest of its stream from
its request thread, as before, so a slow reader never holds up the others.

Only where the bytes would be the same: gunicorn's own client socket, plain TCP, HTTP/1.1 (the
body in chunks, framed here as gunicorn frames them), no wrapper re-framing the body, and
routes whose line maker turns each event into exactly one line without user code (a custom
output formatter runs on the request thread, where a slow one delays only its own stream).
A stream of n choices (a HandleGroup) is written the same way, each delivery's lines of every
choice in one chunk, until each choice has its final line.
"""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine import CANCEL_CHECK_SECONDS, RequestHandle, TokenEvent

if TYPE_CHECKING:
    from handler.http.choices import HandleGroup

# A route's line for one event: a JSON object, or its text (str: framed as written; bytes: an
# output formatter's). A stateful callable, called once per event in order, by one thread at a
# time: the request thread, or the output thread while it writes the stream.
LineOf = Callable[[TokenEvent], dict | str | bytes]
TextOf = Callable[[dict | str | bytes, TokenEvent], str | bytes]  # a line as written


# Set in a request's environ by a route that re-frames the body it wraps (the SageMaker runtime's
# event stream): those bytes must all pass through the wrapper.
REFRAMED = "batchyard.reframed_body"


def direct_socket(environ: dict) -> socket.socket | None:
    """The client's socket when this response's stream may be written around gunicorn."""
    sock = environ.get("gunicorn.socket")
    if (environ.get(REFRAMED) or not isinstance(sock, socket.socket)
            or isinstance(sock, ssl.SSLSocket)
            or environ.get("SERVER_PROTOCOL") != "HTTP/1.1"
            or environ.get("REQUEST_METHOD") == "HEAD"):
        return None
    # gunicorn hands the request a blocking socket; one with a timeout would make send() wait
    return sock if sock.gettimeout() is None else None


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked HTTP/1.1 body, as gunicorn writes it (never empty: an empty
    chunk ends the body)."""
    return b"%X\r\n%b\r\n" % (len(data), data)


class DirectWriter:
    """Writes one stream's lines from the output thread until the stream ends, the client's
    socket is full or fails, or the output thread stops; the request thread waits in write()."""

    def __init__(self, handle: RequestHandle | HandleGroup, sock: socket.socket,
                 line_of: LineOf, text_of: TextOf) -> None:
        self._handle = handle
        self._sock = sock
        self._line_of = line_of
        self._text_of = text_of
        self._lock = threading.Lock()  # held while lines are made: by one thread only
        self._done = threading.Event()  # the output thread has let go of the stream
        self._unsent = b""  # a chunk the client's socket did not take whole
        self._error: BaseException | None = None
        self.ended = False  # the stream's final line is written

    def write(self) -> None:
        """Have the output thread write each event's line (made text by `text_of`); return
        once the stream is written, or once the request thread must write the rest itself (the
        events after those taken here). Raises what a line maker or the socket raised."""
        self._handle.on_delivery(self._drive)
        try:
            self._drive()  # what came while the response's headers went out
            while not self._done.wait(CANCEL_CHECK_SECONDS):
                self._handle.check_cancel()  # a client gone before its next token
                if not self._handle.events_may_come():
                    self._let_go()  # the request thread reads the loop's final event itself
        finally:  # whatever interrupts the wait, the output thread writes no more
            if not self._done.is_set():
                self._let_go()
        if self._unsent:
            self._sock.sendall(self._unsent)  # on the request thread: it may wait
        if self._error is not None:
            raise self._error

    def _let_go(self) -> None:
        with self._lock:
            self._handle.on_delivery(None)
            self._done.set()

    def _drive(self) -> None:
        """The output thread's turn: every queued event's line, in one chunk, without waiting."""
        with self._lock:
            if self._done.is_set():
                return
            parts: list[bytes] = []
            line_of, text_of = self._line_of, self._text_of
            ready = self._handle.take_ready()
            try:
                for event in ready:
                    text = text_of(line_of(event), event)
                    parts.append(text.encode() if isinstance(text, str) else text)
                # every choice's final event taken (one, for a lone request), and its line made
                self.ended = self._handle.finished
            except Exception as err:  # a line maker's failure: the request thread raises it
                self._error = err
            data = parts[0] if len(parts) == 1 else b"".join(parts)
            sent = self._send(chunk(data)) if data else True
            if self.ended or self._error is not None or not sent:
                self._handle.on_delivery(None)
                self._done.set()

    def _send(self, data: bytes) -> bool:
        """Send without waiting; False when the socket failed or took part of it (the rest is
        kept for the request thread)."""
        try:
            sent = self._sock.send(data, socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        except OSError as err:  # the client is gone: as when gunicorn's write fails
            self._error = err
            return False
        self._unsent = data[sent:]
        return not self._unsent
