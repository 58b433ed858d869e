"""Which adapters exist and which sit in device slots. Pure Python (the reading is
engine/lora/peft_files.py's; the device copies engine/lora/weights.py's).

AdapterRegistry: the adapters requests may name (name -> folder), the most recently used held
read in host memory (max_cpu_loras; the rest are read again from their folder when needed). An
adapter unregistered while requests use it retires: new requests cannot name it, those running
finish with it (a preempted one reloads it), and it is forgotten when none is left.

SlotTable: which adapter key each of the max_loras device slots holds. A step's adapters (at most
max_loras: the scheduler admits no more distinct ones) keep their slots; one not in a slot takes
a free slot, else the least recently used slot not needed by this step.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable

from engine.lora.errors import AdapterError, AdapterNotFound
from engine.lora.peft_files import LoraAdapter, read_adapter

logger = logging.getLogger(__name__)


class AdapterRegistry:
    """Every adapter requests may name, and an LRU of those read. A registration is known by
    its key, "name@n" (the name's n-th registration): sequences, slots and the prefix cache
    hold keys, so weights registered again under an old name never mix with the old ones."""

    def __init__(self, max_rank: int, max_cpu_loras: int,
                 check: Callable[[LoraAdapter], None]) -> None:
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.check = check  # raises AdapterError when an adapter does not fit the model
        self.current: dict[str, str] = {}  # name -> key of its registration
        self.paths: dict[str, str] = {}  # key -> folder, of current and retiring keys
        self.loaded: OrderedDict[str, LoraAdapter] = OrderedDict()  # key -> read; LRU first
        self.registrations: dict[str, int] = {}  # name -> times registered

    def register(self, name: str, path: str) -> LoraAdapter:
        """Read, check and register; AdapterError (the reason) if refused."""
        if not name or len(name) > 256 or any(c in name for c in "/\\\0"):
            raise AdapterError(f"adapter name {name!r} must be 1-256 characters without "
                               "slashes")
        if name in self.current:
            raise AdapterError(f"adapter {name!r} is already registered")
        adapter = read_adapter(name, path, self.max_rank)
        self.check(adapter)
        self.registrations[name] = self.registrations.get(name, 0) + 1
        key = f"{name}@{self.registrations[name]}"
        self.current[name] = key
        self.paths[key] = adapter.path
        self._keep(key, adapter)
        return adapter

    def unregister(self, name: str, in_use: Iterable[str]) -> None:
        """No new request may name it; requests using it (their keys: `in_use`) finish."""
        if name not in self.current:
            raise AdapterNotFound(name)
        key = self.current.pop(name)
        if key not in set(in_use):
            self._drop(key)
            return
        try:  # held read while it retires: its folder may go before its requests end
            self.get(key)
        except AdapterError:
            logger.warning("adapter %s retires unread: %s's requests fail if preempted", key,
                           name)

    def forget_unused(self, in_use: Iterable[str]) -> list[str]:
        """Drop retired keys no request uses any more; returns them."""
        live = set(in_use) | set(self.current.values())
        done = [key for key in self.paths if key not in live]
        for key in done:
            self._drop(key)
        return done

    def key_of(self, name: str) -> str | None:
        """The key a new request naming `name` gets (None: not registered)."""
        return self.current.get(name)

    def path_of(self, key: str) -> str:
        return self.paths[key]

    def get(self, key: str) -> LoraAdapter:
        """The adapter of `key` (read again from its folder when the host cache dropped it)."""
        if key in self.loaded:
            self.loaded.move_to_end(key)
            return self.loaded[key]
        if key not in self.paths:
            raise AdapterNotFound(key)
        adapter = read_adapter(key.rsplit("@", 1)[0], self.paths[key], self.max_rank)
        self._keep(key, adapter)
        return adapter

    def _keep(self, key: str, adapter: LoraAdapter) -> None:
        self.loaded[key] = adapter
        self.loaded.move_to_end(key)
        # a retired key stays read: its folder may be gone (SageMaker removes it with the
        # adapter component) while its requests still run
        current = set(self.current.values())
        evictable = [k for k in self.loaded if k in current and k != key]
        while len(self.loaded) > self.max_cpu_loras and evictable:
            self.loaded.pop(evictable.pop(0))

    def _drop(self, key: str) -> None:
        self.paths.pop(key, None)
        self.loaded.pop(key, None)


class SlotTable:
    """The adapter key each device slot holds."""

    def __init__(self, num_slots: int) -> None:
        self.held: list[str | None] = [None] * num_slots
        self.last_used = [0] * num_slots
        self.clock = 0

    def assign(self, wanted: Iterable[str]) -> tuple[dict[str, int], list[tuple[int, str]]]:
        """Slots for a step's adapter keys: (key -> slot, [(slot, key) to load first])."""
        wanted = list(dict.fromkeys(wanted))
        assert len(wanted) <= len(self.held), "more adapters in a step than slots"
        self.clock += 1
        slots = {key: self.held.index(key) for key in wanted if key in self.held}
        for slot in slots.values():
            self.last_used[slot] = self.clock
        loads = []
        for key in wanted:
            if key in slots:
                continue
            free = [s for s in range(len(self.held)) if self.last_used[s] != self.clock]
            slot = min(free, key=lambda s: (self.held[s] is not None, self.last_used[s]))
            self.held[slot] = key
            self.last_used[slot] = self.clock
            slots[key] = slot
            loads.append((slot, key))
        return slots, loads

    def forget(self, slot: int) -> None:
        """`slot`'s load failed: it holds no adapter (the next step loads again)."""
        self.held[slot] = None
        self.last_used[slot] = 0

    def check_integrity(self) -> None:
        names = [h for h in self.held if h is not None]
        assert len(names) == len(set(names)), "an adapter in two slots"
