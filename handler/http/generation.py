"""Running one generation for the HTTP edge: submit to the engine loop, wait for a whole
answer, or stream it line by line (a client that goes away aborts its request)."""

from __future__ import annotations

import contextlib
import json
import logging
import select
import socket
import time
from collections.abc import Callable, Iterator

from flask import Response, has_request_context, request

from engine import (
    EngineDeadError,
    GenerationRequest,
    QueueFullError,
    RequestError,
    RequestHandle,
    SamplingParams,
    TokenEvent,
    UnknownAdapter,
)
from handler.http.adapters import adapter_of, remember
from handler.http.choices import HandleGroup
from handler.http.direct_stream import DirectWriter, LineOf, direct_socket
from handler.http.schemas import (
    Decode,
    GenerateRequest,
    HTTPError,
    bad_request,
    details_dict,
    final_error,
    framed,
    token_dict,
    token_line,
    top_tokens,
    unknown_adapter,
)
from handler.http.state import ServerState

logger = logging.getLogger(__name__)

JSONLINES = "application/jsonlines"
# nginx's code for "client closed request": only metrics and logs see it, the client is gone.
CLIENT_GONE = HTTPError(499, "ClientClosedRequest", "the client closed the connection")
SSE = "text/event-stream"
# (JSON object, or text an output formatter made, to write; the event it reports)
Lines = Iterator[tuple[dict | str | bytes, TokenEvent]]


def submit(state: ServerState, prompts: list[list[int]],
           params: SamplingParams | list[SamplingParams], *, stream: bool) -> list[RequestHandle]:
    """Queue every prompt (with its own params when given a list), or none: an invalid one, a
    full queue or a dead engine is an HTTP error and nothing of the request stays queued."""
    deadline = None if stream else time.monotonic() + state.config.predict_timeout
    each = params if isinstance(params, list) else [params] * len(prompts)
    requests = [GenerationRequest(tuple(ids), p, deadline)
                for ids, p in zip(prompts, each, strict=True)]
    with engine_errors():
        handles = state.engine.submit_all(requests)
    remember(handles, each)  # for the metrics' adapter label
    gone = client_gone_check(request.environ)
    if gone is not None:
        for handle in handles:
            handle.cancel_when(gone)
    return handles


def admit(state: ServerState, count: int) -> None:
    """Refuse at once (503) what the engine could not take now, before tokenizing: under
    overload a refusal costs no tokenizer time, so clients retrying at once cost little."""
    with engine_errors():
        state.engine.check_room(count)


@contextlib.contextmanager
def engine_errors() -> Iterator[None]:
    """The engine boundary's refusals as HTTP errors."""
    try:
        yield
    except UnknownAdapter as err:  # before RequestError, its base
        raise unknown_adapter(err.adapter, str(err)) from err
    except RequestError as err:
        raise bad_request(str(err)) from err
    except QueueFullError as err:
        raise HTTPError(503, "QueueFull", f"too many requests in flight: {err}; raise "
                        "job_queue_size or retry later", {"Retry-After": "1"}) from err
    except EngineDeadError as err:
        raise HTTPError(503, "ServiceUnavailable", str(err)) from err


def client_gone_check(environ: dict) -> Callable[[], bool] | None:
    """A check that the client closed its connection (None when the server gives no socket,
    e.g. Flask's test client). The body is read by now, so a readable socket with nothing to
    read is the client's FIN; pipelined bytes (a next request) mean it is still there."""
    sock = environ.get("gunicorn.socket")
    if sock is None:
        return None

    def gone() -> bool:
        # poll, not select (descriptors above 1024), and no recv before it says readable: the
        # socket may carry a timeout, and a recv that waits for it would hold the request.
        poller = select.poll()
        poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
        try:
            ready = poller.poll(0)
            if not ready:
                return False  # nothing to read: the client is waiting for its answer
            if ready[0][1] & (select.POLLHUP | select.POLLERR):
                return True
            return sock.recv(1, socket.MSG_PEEK) == b""
        except (BlockingIOError, InterruptedError, TimeoutError):
            return False
        except OSError:
            return True  # reset or closed

    return gone


def collect_all(state: ServerState, handles: list[RequestHandle], start: float
                ) -> list[list[TokenEvent]]:
    """collect() each (n choices, a list of prompts); when one fails, the others are aborted
    (their KV freed) rather than left to run to predict_timeout."""
    try:
        return [collect(state, handle, start) for handle in handles]
    finally:
        for handle in handles:  # no-op for those that finished
            handle.abort()


def collect(state: ServerState, handle: RequestHandle, start: float) -> list[TokenEvent]:
    """Wait for a non-streaming request's events; an abnormal end becomes an HTTP error."""
    events, times = [], []
    for event, delivered in handle.all_events():  # woken once, at the end
        events.append(event)
        if event.token_id is not None:
            times.append(delivered)
    error = CLIENT_GONE if handle.cancelled else final_error(events[-1])
    status = error.code if error else 200
    if error is not None:
        state.metrics.on_abort(_abort_reason(handle, events[-1]))
    state.metrics.on_request(status, handle.num_prompt_tokens, times, start, time.monotonic(),
                             adapter_of(handle))
    _log(handle, events[-1], start, times)
    if error is not None:
        error = HTTPError(error.code, error.type, error.message)  # CLIENT_GONE is shared
        error.counted = True
        raise error
    return events


class GenerateLines:
    """An /invocations stream's line for each event: {"token"} (+ "top_tokens"), and on the
    last one the whole generated_text and details. With `sse` given (nothing reshapes the
    lines: no output formatter, not TGI's), a plain token line (one per token) comes as its
    framed text, json.dumps's own, made ~3x sooner; other lines as JSON objects."""

    def __init__(self, gen: GenerateRequest, decode: Decode, sse: bool | None = None) -> None:
        self._gen = gen
        self._decode = decode
        self._sse = sse
        self._texts: list[str] = []

    def __call__(self, event: TokenEvent) -> dict | str:
        self._texts.append(event.text)
        gen = self._gen
        if self._sse is not None and event.finish_reason is None and not gen.top_n_tokens:
            body = token_line(event)
            if body is not None:
                return framed(body, self._sse)
        line: dict = {}
        if event.token_id is not None:
            line["token"] = token_dict(event)
            if gen.top_n_tokens:
                line["top_tokens"] = top_tokens(event, self._decode)
        if event.finished:
            text = "".join(self._texts)
            line["generated_text"] = (gen.inputs[0] + text) if gen.return_full_text else text
            line["details"] = details_dict([event], with_tokens=False)
        return line


def stream_response(line_of: LineOf, handle: RequestHandle | HandleGroup, state: ServerState,
                    *, sse: bool, done_line: bool, start: float,
                    trailer: Callable[[TokenEvent], dict] | None = None,
                    coalesce: bool = False, direct: bool = False) -> Response:
    """Write each event's line (`line_of`) as it comes; a client that goes away aborts its
    request (frees its KV). `trailer` makes one more line from the last event of a request
    that ended well (OpenAI's usage chunk). `coalesce`: the lines of events already queued go
    out in one write. `direct` (lines made without user code): where the response allows it,
    the engine's output thread writes them (handler/http/direct_stream.py)."""
    sock = (direct_socket(request.environ) if coalesce and direct and has_request_context()
            else None)
    written = _Written(sse)

    def generate() -> Iterator[str | bytes]:
        lines_left = ((line_of(event), event) for event in handle.events())
        try:
            # the first line goes through gunicorn, which sends the response's headers with it
            yield from _by_request_thread(lines_left, handle, written, coalesce,
                                          until_first_write=sock is not None)
            if sock is not None and written.last is not None and not handle.finished:
                writer = DirectWriter(handle, sock, line_of, written.text)
                written.writer = "output_thread"
                writer.write()
                if not writer.ended:  # handed back: a slow client, or the loop stopped
                    written.writer = "handed_back"
                # the rest of a stream handed back: the events the writer did not take
                yield from _by_request_thread(lines_left, handle, written, coalesce)
            last = written.last
            if trailer is not None and last is not None and written.failed is None:
                yield line_text(trailer(last), sse)
            if done_line:  # OpenAI's end-of-stream marker
                yield "data: [DONE]\n\n"
        finally:
            _end_stream(handle, state, written, start)

    # werkzeug encodes each str item and passes bytes (_iter_encoded takes Iterable[str | bytes]);
    # its constructor's annotation wants one kind or the other.
    return Response(generate(), mimetype=SSE if sse else JSONLINES,  # type: ignore[arg-type]
                    headers={"X-Accel-Buffering": "no", "Cache-Control": "no-cache"})


class _Written:
    """A stream's lines made so far: their text, the times of its tokens, its last event, and
    the first final event that was an error (of any of its choices)."""

    def __init__(self, sse: bool) -> None:
        self.sse = sse
        self.times: list[float] = []
        self.last: TokenEvent | None = None
        self.failed: TokenEvent | None = None
        self.writer = "request_thread"  # who wrote the stream after its first line

    def text(self, line: dict | str | bytes, event: TokenEvent) -> str | bytes:
        self.last = event
        if event.token_id is not None:
            self.times.append(time.monotonic())
        if event.finish_reason is not None and (error := final_error(event)) is not None:
            self.failed = self.failed or event
            line = {**error.body(), "error": error.message, "details": {"finish_reason": "error"}}
        # type() first: a plain token line is a str, and isinstance of a union costs more
        if type(line) is str or isinstance(line, str | bytes):
            return line
        return line_text(line, self.sse)


def _by_request_thread(lines: Lines, handle: RequestHandle | HandleGroup, written: _Written,
                       coalesce: bool, until_first_write: bool = False) -> Iterator[str | bytes]:
    unsent: list[str] = []  # lines held while the events behind them are already here
    try:
        for line, event in lines:
            text = written.text(line, event)
            if isinstance(text, bytes):  # an output formatter wrote it
                if unsent:
                    yield "".join(unsent)
                    unsent.clear()
                yield text
                continue
            unsent.append(text)
            # When the server lags behind the engine (many streams, few cores), each chunk
            # costs a syscall and a trip through gunicorn: one for all that is here.
            if not coalesce or event.finished or not handle.has_queued_events():
                yield "".join(unsent)
                unsent.clear()
                if until_first_write:
                    return
    except Exception:
        if unsent:  # lines made before the failure go out, as they would have alone
            yield "".join(unsent)
        raise
    if unsent:
        yield "".join(unsent)


def _end_stream(handle: RequestHandle | HandleGroup, state: ServerState, written: _Written,
                start: float) -> None:
    handle.abort()  # no-op when finished; frees KV when the client disconnected
    last = written.last
    # How it ended: every choice's final line written (else the client left first), and of
    # those the first that was an error, if any
    end = (written.failed or last) if handle.finished and last and last.finished else None
    status = _stream_status(handle, end)
    if status != 200:
        state.metrics.on_abort(_abort_reason(handle, end))
    state.metrics.on_stream(written.writer)
    state.metrics.on_request(status, handle.num_prompt_tokens, written.times, start,
                             time.monotonic(), adapter_of(handle))
    if last is not None:
        _log(handle, last, start, written.times)


def line_text(line: dict, sse: bool) -> str:
    return framed(json.dumps(line), sse)


def _stream_status(handle: RequestHandle | HandleGroup, end: TokenEvent | None) -> int:
    if handle.cancelled or end is None:
        return CLIENT_GONE.code  # the client closed the connection first
    error = final_error(end)
    return error.code if error else 200


def _abort_reason(handle: RequestHandle | HandleGroup, last: TokenEvent | None) -> str:
    """Why a request ended early, for the aborted-requests metric (`last`: its final event,
    None when it did not get there)."""
    if handle.cancelled or last is None or not last.finished:
        return "client_disconnect"
    return {"abort": "shutdown", "timeout": "timeout"}.get(last.finish_reason or "", "error")


def _log(handle: RequestHandle | HandleGroup, last: TokenEvent, start: float,
         times: list[float]) -> None:
    ttft = f"{(times[0] - start) * 1000:.0f}" if times else "-"
    logger.info("request %s: %d prompt tokens, %d generated, finish %s, ttft %s ms, total %.0f ms",
                handle.request_id, handle.num_prompt_tokens, last.num_output_tokens,
                last.finish_reason, ttft, (time.monotonic() - start) * 1000)
