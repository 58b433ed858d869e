"""The serving side's view of the core's LoRA adapters: a mirror of the registered list (what
EngineClient's boundary checks a request's adapter against, without asking the core), and the
adapter calls waiting for their reply.

The core owns the registry (LLMEngine is not thread-safe): a call is an inbox message, answered
in the core's next update together with the new list. The output thread applies that update
here, the list first, so a caller that returns sees its adapter in the mirror. With several
serving processes, every one receives the list whenever it changes."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

from engine.core.adapters import AdapterList, AdapterReply
from engine.core.engine_core import CoreMessage, CoreUpdate
from engine.inputs import AddAdapter, RemoveAdapter

_POLL_SECONDS = 0.5  # how often a waiting caller re-checks that a reply can still come


class _Waiting:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.reply: AdapterReply | None = None  # None once done: the core stopped first


class AdapterMirror:
    """Thread-safe: request threads call and read; the output thread applies and closes."""

    def __init__(self, send: Callable[[CoreMessage], None], id_prefix: str,
                 adapters: AdapterList, delivering: Callable[[], bool]) -> None:
        self._send = send
        self._prefix = id_prefix  # call ids are unique among the fronts of a shared core
        self._ids = itertools.count()
        self._delivering = delivering  # whether the output thread still runs
        self._lock = threading.Lock()
        self._list: dict[str, str] = dict(adapters)  # replaced whole, never changed in place
        self._waiting: dict[str, _Waiting] = {}
        self._open = False  # replies can come: the output thread runs

    def listed(self) -> list[tuple[str, str]]:
        return sorted(self._list.items())

    def has(self, name: str) -> bool:
        return name in self._list

    def names(self) -> list[str]:
        return sorted(self._list)

    def open(self) -> None:
        with self._lock:
            self._open = True

    def call(self, make: Callable[[str], AddAdapter | RemoveAdapter]) -> AdapterReply | None:
        """Send the call `make(call_id)` builds and wait for the core's reply; None if the core
        stopped (or was never started) before it answered."""
        call_id = f"{self._prefix}adapter-{next(self._ids)}"
        waiting = _Waiting()
        with self._lock:
            if not self._open:
                return None
            self._waiting[call_id] = waiting
        self._send(make(call_id))
        # close() wakes us; the poll is for an output thread that died without reaching it
        while not waiting.done.wait(_POLL_SECONDS) and self._delivering():
            pass
        with self._lock:
            self._waiting.pop(call_id, None)
        return waiting.reply

    def apply(self, update: CoreUpdate) -> None:
        """On the output thread: the new list, then the replies it answers."""
        if update.adapters is not None:
            self._list = dict(update.adapters)
        if not update.replies:
            return
        with self._lock:
            for reply in update.replies:
                waiting = self._waiting.pop(reply.call_id, None)
                if waiting is not None:
                    waiting.reply = reply
                    waiting.done.set()

    def close(self) -> None:
        """The output thread stops: no reply can come; wake every caller still waiting."""
        with self._lock:
            self._open = False
            waiting, self._waiting = self._waiting, {}
        for entry in waiting.values():
            entry.done.set()
