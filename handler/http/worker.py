"""The gunicorn worker: gthread, with errors gunicorn answers itself (a request line or headers
over the limits, a malformed request) written as JSON in the server's error shape instead of
gunicorn's HTML page, and a SIGTERM that drains while it keeps answering.

gthread's own SIGTERM handling stops accepting at once and leaves the listening socket open
until the worker exits: a client connecting meanwhile hangs, then gets a reset. Here the worker
keeps accepting while the app drains, so /ping and new requests get a prompt 503; it stops
accepting only once the drain is over."""

from __future__ import annotations

import json
import logging
import threading

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
        super().init_process()

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
