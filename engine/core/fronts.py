"""Fronts: the core's side of several serving processes (engine/core/server.py).

EngineCore sees one inbox and one outbox, as with a single front: receive() merges the messages
of every connected front, publish() sends each front the outputs of its own requests (with the
gauges, which every front reports, and the step's facts to one front only, so that /metrics
counts each step once). An adapter call's reply goes to the front that made it; the adapter
list, whenever it changes, to every front (each keeps a mirror that its boundary checks)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener, Pipe

from engine.core.adapters import AdapterList
from engine.core.engine_core import CoreMessage, CoreUpdate
from engine.core.process import CoreFailed, CoreReady, FrontReading, Readiness, send_message
from engine.inputs import AbortRequest, AddAdapter, AddRequest, RemoveAdapter, StopCore
from engine.outputs import Gauges

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
        self._callers: dict[str, Connection] = {}  # adapter call id -> the front that asked
        self._adapters: AdapterList = ()  # the latest list published
        self._gauges: Gauges | None = None  # the latest gauges published
        self._greeted: dict[Connection, AdapterList] = {}  # the list each front was greeted with
        self._had_front = False
        threading.Thread(target=self._accept, name="front-accept", daemon=True).start()

    def open(self, hello: CoreReady | CoreFailed) -> None:
        """Greet the fronts that wait now, and later ones as they come, with `hello`."""
        with self._lock:
            self._hello = hello
        if isinstance(hello, CoreReady):
            self._adapters, self._gauges = hello.adapters, hello.gauges
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
        hello = self._hello
        if isinstance(hello, CoreReady):  # later fronts learn of adapters registered since
            hello = replace(hello, adapters=self._adapters)
        for conn in pending:
            try:
                conn.send(hello)
            except OSError:
                conn.close()
                continue
            self._fronts.append(conn)
            self._ready.add(conn)
            self._greeted[conn] = self._adapters
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
                    self._start_reading(conn)
                    continue
                if isinstance(message, AddRequest):
                    self._owner[message.request_id] = conn
                elif isinstance(message, (AddAdapter, RemoveAdapter)):
                    self._callers[message.call_id] = conn
                messages.append(message)
        except (EOFError, OSError):  # its process died
            return messages + self._leave(conn, goodbye=False)
        return messages

    def _start_reading(self, conn: Connection) -> None:
        """Updates go to `conn` from now on; the adapter list first if it changed since its
        greeting (while it loaded its tokenizer, updates went to the others only)."""
        self._reading.append(conn)
        if self._greeted.pop(conn, self._adapters) != self._adapters and self._gauges is not None:
            self._send(conn, CoreUpdate([], self._gauges, adapters=self._adapters))

    def _leave(self, conn: Connection, goodbye: bool) -> list[AbortRequest]:
        """Forget a front; what it still had running is aborted (nobody would read it)."""
        self._fronts.remove(conn)
        self._ready.remove(conn)
        if conn in self._reading:
            self._reading.remove(conn)
        self._greeted.pop(conn, None)
        for call_id in [c for c, caller in self._callers.items() if caller is conn]:
            del self._callers[call_id]
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
        replies: dict[Connection, list] = {}
        for reply in update.replies:
            caller = self._callers.pop(reply.call_id, None)
            if caller is not None:
                replies.setdefault(caller, []).append(reply)
        self._gauges = update.gauges
        if update.adapters is not None:
            self._adapters = update.adapters
        for i, conn in enumerate(self._reading):
            self._send(conn, CoreUpdate(mine[conn], update.gauges,
                                        update.stats if i == 0 else None,
                                        tuple(replies.get(conn, ())), update.adapters))

    def _send(self, conn: Connection, update: CoreUpdate | None) -> None:
        try:
            send_message(conn, update)
        except OSError:  # it died; receive() finds its EOF and aborts its requests
            pass
