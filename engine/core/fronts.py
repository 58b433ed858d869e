"""Fronts: the core's side of several serving processes (engine/core/server.py).

EngineCore sees one inbox and one outbox, as with a single front: receive() merges the messages
of every connected front, publish() sends each front the outputs of its own requests (with the
gauges, which every front reports, and the step's facts to one front only, so that /metrics
counts each step once)."""

from __future__ import annotations

import logging
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener, Pipe

from engine.core.engine_core import CoreMessage, CoreUpdate
from engine.core.process import CoreFailed, CoreReady, FrontReading, Readiness, send_message
from engine.inputs import AbortRequest, AddRequest, StopCore

logger = logging.getLogger(__name__)


class Fronts:
    """Accepts fronts on a thread from the start; open() greets them (CoreReady or CoreFailed)
    once the model has loaded. receive() and publish() run on the core's thread only."""

    def __init__(self, listener: Listener) -> None:
        self._listener = listener
        self._lock = threading.Lock()
        self._pending: list[Connection] = []  # accepted, not greeted yet
        self._hello: CoreReady | CoreFailed | None = None  # once the model loaded or failed
        self._wake_reader, self._wake_writer = Pipe(duplex=False)
        self._fronts: list[Connection] = []
        self._ready = Readiness(self._wake_reader)  # and every front, while it is connected
        self._reading: list[Connection] = []  # those that said FrontReading: updates go there
        self._owner: dict[str, Connection] = {}  # request id -> the front that sent it
        self._had_front = False
        threading.Thread(target=self._accept, name="front-accept", daemon=True).start()

    def open(self, hello: CoreReady | CoreFailed) -> None:
        """Greet the fronts that wait now, and later ones as they come, with `hello`."""
        with self._lock:
            self._hello = hello
        self._adopt()

    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except (AuthenticationError, EOFError, ConnectionError):
                continue  # not one of ours, or it left during the handshake
            except OSError as err:  # e.g. out of descriptors: the next front may still come
                logger.warning("engine core: accepting a serving process failed: %s", err)
                time.sleep(0.1)
                continue
            with self._lock:
                self._pending.append(conn)
            self._wake_writer.send(None)

    def _adopt(self) -> None:
        with self._lock:
            if self._hello is None:
                return
            pending, self._pending = self._pending, []
        for conn in pending:
            try:
                conn.send(self._hello)
            except OSError:
                conn.close()
                continue
            self._fronts.append(conn)
            self._ready.add(conn)
            self._had_front = True
            logger.info("a serving process connected (%d now)", len(self._fronts))

    # --- EngineCore's inbox and outbox ---

    def receive(self, timeout: float | None) -> list:
        messages: list = []
        for conn in self._ready.ready(0 if timeout is None else timeout):
            if conn is self._wake_reader:
                while self._wake_reader.poll(0):
                    self._wake_reader.recv()
                self._adopt()
            else:
                messages += self._read(conn)
        if self._had_front and not self._fronts:
            messages.append(StopCore())  # the last front left: nothing can reach us any more
        return messages

    def _read(self, conn: Connection) -> list[CoreMessage]:
        messages: list[CoreMessage] = []
        try:
            readable = True  # receive() found it so: a message at least, or its end
            while readable:
                message = conn.recv()
                readable = conn in self._ready.ready()
                if isinstance(message, StopCore):  # this front shuts down
                    return messages + self._leave(conn, goodbye=True)
                if isinstance(message, FrontReading):
                    self._reading.append(conn)
                    continue
                if isinstance(message, AddRequest):
                    self._owner[message.request_id] = conn
                messages.append(message)
        except (EOFError, OSError):  # its process died
            return messages + self._leave(conn, goodbye=False)
        return messages

    def _leave(self, conn: Connection, goodbye: bool) -> list[AbortRequest]:
        """Forget a front; what it still had running is aborted (nobody would read it)."""
        self._fronts.remove(conn)
        self._ready.remove(conn)
        if conn in self._reading:
            self._reading.remove(conn)
        orphans = [rid for rid, owner in self._owner.items() if owner is conn]
        for rid in orphans:
            del self._owner[rid]
        if goodbye:
            try:
                conn.send(None)  # its output thread ends
            except OSError:
                pass
        conn.close()
        logger.info("a serving process left (%d now); %d of its requests aborted",
                    len(self._fronts), len(orphans))
        return [AbortRequest(rid) for rid in orphans]

    def publish(self, update: CoreUpdate | None) -> None:
        if update is None:  # the core stopped
            for conn in self._fronts:
                self._send(conn, None)
            return
        mine: dict[Connection, list] = {conn: [] for conn in self._reading}
        for out in update.outputs:
            owner = (self._owner.pop(out.request_id, None) if out.finish_reason is not None
                     else self._owner.get(out.request_id))
            if owner in mine:
                mine[owner].append(out)
        for i, conn in enumerate(self._reading):
            self._send(conn, CoreUpdate(mine[conn], update.gauges,
                                        update.stats if i == 0 else None))

    def _send(self, conn: Connection, update: CoreUpdate | None) -> None:
        try:
            send_message(conn, update)
        except OSError:  # it died; receive() finds its EOF and aborts its requests
            pass
