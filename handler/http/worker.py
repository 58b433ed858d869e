"""The gunicorn worker: gthread, with errors gunicorn answers itself (a request line or headers
over the limits, a malformed request) written as JSON in the server's error shape instead of
gunicorn's HTML page, and a SIGTERM that drains while it keeps answering.

gthread's own SIGTERM handling stops accepting at once and leaves the listening socket open
until the worker exits: a client connecting meanwhile hangs, then gets a reset. Here the worker
keeps accepting while the app drains, so /ping and new requests get a prompt 503; it stops
accepting only once the drain is over.

gthread closes a connection (`Connection: close`, HTTP/1.0) on its main thread, lingering until
the client closes its end (RFC 9112 9.6: so that unread bytes do not turn the close into a reset
that truncates the answer), up to 2 s. That blocked the main loop: no accept, no keep-alive
dispatch, no other close, for every client that keeps its socket open after the answer, and a
client's round trip per close even when it does not. Here the linger runs in the main loop's
poller instead and blocks nothing."""

from __future__ import annotations

import json
import logging
import selectors
import socket
import threading
import time
from functools import partial

from gunicorn import util
from gunicorn.workers.gthread import ThreadWorker

logger = logging.getLogger(__name__)

# gunicorn's parser limits, set explicitly (these are its defaults): SageMaker's own limit on
# X-Amzn-SageMaker-Custom-Attributes is 1,024 characters, far below the field size.
LIMIT_REQUEST_LINE = 4094  # bytes of "POST /path HTTP/1.1"
LIMIT_REQUEST_FIELDS = 100  # header fields
LIMIT_REQUEST_FIELD_SIZE = 8190  # bytes of one header field
HEADER_LIMITS = {"limit_request_line": LIMIT_REQUEST_LINE,
                 "limit_request_fields": LIMIT_REQUEST_FIELDS,
                 "limit_request_field_size": LIMIT_REQUEST_FIELD_SIZE}

# gunicorn's own bounds on the linger after a close (util.close_graceful).
LINGER_SECONDS = 2.0
LINGER_MAX_BYTES = 65536

_TYPES = {400: "BadRequest", 403: "Forbidden", 414: "URITooLong", 417: "ExpectationFailed",
          431: "RequestHeaderFieldsTooLarge", 500: "InternalServerError",
          501: "NotImplemented"}
_MESSAGES = {
    414: f"the request line is over {LIMIT_REQUEST_LINE} bytes",
    431: f"request headers over the limits: at most {LIMIT_REQUEST_FIELDS} fields of at most "
         f"{LIMIT_REQUEST_FIELD_SIZE} bytes each",
    500: "internal error; see server logs",
}


def json_error_bytes(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 error response with the JSON body every other error has."""
    body = json.dumps({"code": status, "type": _TYPES.get(status, reason.replace(" ", "")),
                       "message": _MESSAGES.get(status) or f"malformed HTTP request: {message}"})
    head = (f"HTTP/1.1 {status} {reason}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    return (head + body).encode("latin-1", errors="replace")


def write_json_error(sock, status_int: int, reason: str, mesg: str) -> None:
    """Stands in for gunicorn.util.write_error (same signature), in the worker process only."""
    util.write_nonblock(sock, json_error_bytes(status_int, reason, mesg))


class JsonErrorWorker(ThreadWorker):
    """gunicorn's gthread worker: JSON error answers, and a drain on SIGTERM."""

    def init_process(self) -> None:
        # gunicorn writes parse errors through this module function; the worker process is
        # ours alone, so replacing it here changes nothing for any other program.
        util.write_error = write_json_error
        self._draining = False
        self._lingering: dict[socket.socket, list] = {}  # -> [deadline, bytes drained]
        super().init_process()

    def run(self) -> None:
        try:
            super().run()
        finally:  # gthread has closed its poller: close what still lingers
            for sock in self._lingering:
                util.close(sock)
            self._lingering.clear()

    def enqueue_req(self, conn) -> None:
        # Every connection passes here before its first request; from then on its graceful
        # close (on the main thread, in finish_request) lingers in the poller.
        if "close" not in vars(conn):
            conn.close = partial(self._close, conn)
        super().enqueue_req(conn)

    def _close(self, conn, graceful: bool = False) -> None:
        sock = conn.sock
        if not graceful:
            util.close(sock)
            return
        try:
            sock.shutdown(socket.SHUT_WR)  # the client reads the end of the answer
            sock.setblocking(False)
            self.poller.register(sock, selectors.EVENT_READ, self._on_linger_readable)
        except (OSError, ValueError, KeyError):
            util.close(sock)
            return
        self._lingering[sock] = [time.monotonic() + LINGER_SECONDS, 0]
        # Still a connection: counted against worker_connections, and waited for by gthread's
        # graceful stop (gthread uncounted it before this close).
        self.nr_conns += 1

    def _on_linger_readable(self, sock: socket.socket) -> None:
        state = self._lingering.get(sock)
        if state is None:
            return
        try:
            data = sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        state[1] += len(data)
        if not data or state[1] >= LINGER_MAX_BYTES:
            self._end_linger(sock)

    def _end_linger(self, sock: socket.socket) -> None:
        if self._lingering.pop(sock, None) is not None:
            self.nr_conns -= 1
        try:
            self.poller.unregister(sock)
        except (OSError, ValueError, KeyError):
            pass
        util.close(sock)

    def murder_pending(self) -> None:
        """gthread calls this on every turn of its main loop: end the lingers that expired."""
        super().murder_pending()
        now = time.monotonic()
        for sock in [s for s, (deadline, _) in self._lingering.items() if deadline <= now]:
            self._end_linger(sock)

    def handle_exit(self, sig, frame) -> None:
        """SIGTERM: drain on a thread (a signal handler must return quickly); the main loop
        keeps accepting until the drain is over."""
        if self._draining or not self.alive:
            return
        self._draining = True
        threading.Thread(target=self._drain, name="drain", daemon=True).start()

    def _drain(self) -> None:
        state = getattr(self.app, "state", None)
        try:
            if state is not None:
                logger.info("SIGTERM: draining for up to %g s", state.config.drain_timeout)
                state.shutdown(state.config.drain_timeout)
        except Exception:
            logger.exception("drain failed")
        finally:
            # gthread's own shutdown from here: stop accepting, finish writing the answers
            # in flight (gunicorn's graceful_timeout), close.
            self.alive = False
            self.method_queue.defer(lambda: None)  # wake the main loop
