"""StepBuffer: one step's integers and per-row floats, packed on the host, one copy to the device.

Building each index tensor with its own `torch.tensor(list, device=...)` costs an unpinned,
synchronous host-to-device copy apiece (several per step), and the device idles between them.
Here the runner writes every section (token ids, positions, slots, page tables, sampling
parameters) into one persistent host buffer, pinned on CUDA, and a single non-blocking copy moves
the used prefix; the device views are slices of one persistent device buffer.

int64 throughout: the pool's index ops (index_copy_, gather) and the CPU kernels take int64
indices, so int32 would cost a cast per use; per-row floats are stored as float64 bit patterns
in the same buffer.

On a separate device the host side alternates between two buffers, each with an event recorded
after its upload: step n+1 is packed while step n's upload may still read its buffer (the host
runs ahead of the device: asynchronous scheduling, or steps that sample nothing and so never
wait for a download), and a buffer is written again only once its previous upload is done.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterable, Sequence
from typing import cast

import numpy as np
import torch

logger = logging.getLogger(__name__)

_INITIAL_CAPACITY = 1 << 14  # int64 entries (128 KiB); doubles when a step needs more


class StepBuffer:
    """put()/put_floats() append named sections; upload() returns their device views."""

    def __init__(self, device: torch.device, capacity: int = _INITIAL_CAPACITY) -> None:
        self.device = device
        self._sections: dict[str, tuple[int, tuple[int, ...], bool]] = {}
        self._used = 0
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        # [capacity] int64; the device buffer is the host one on CPU (nothing to copy)
        self.host = self._host_buffer(capacity)
        self._spare = None if self.device.type == "cpu" else self._host_buffer(capacity)
        # CUDA: recorded after the latest upload from `host` / from `_spare`
        self._uploaded: torch.cuda.Event | None = None
        self._spare_uploaded: torch.cuda.Event | None = None
        self._view_host()
        self.dev = self.host if self._spare is None else torch.zeros(
            capacity, dtype=torch.int64, device=self.device)

    def _host_buffer(self, capacity: int) -> torch.Tensor:
        return torch.zeros(capacity, dtype=torch.int64, pin_memory=self.device.type == "cuda")

    def _view_host(self) -> None:
        self._ints = self.host.numpy()
        self._floats = self._ints.view(np.float64)

    @property
    def capacity(self) -> int:
        return self.host.numel()

    def reset(self) -> None:
        """Start a step's sections (on a separate device, in the other host buffer)."""
        self._sections.clear()
        self._used = 0
        if self._spare is not None:
            self.host, self._spare = self._spare, self.host
            self._uploaded, self._spare_uploaded = self._spare_uploaded, self._uploaded
            if self._uploaded is not None:
                self._uploaded.synchronize()  # its last upload has left it
            if self.host.numel() < self._spare.numel():  # the other one grew meanwhile
                self.host = self._host_buffer(self._spare.numel())
            self._view_host()

    def put(self, name: str, values: Sequence[int] | Sequence[Sequence[int]] | np.ndarray,
            shape: tuple[int, ...] | None = None) -> None:
        """Append integers under `name` (viewed with `shape` on the device; default flat): a
        flat sequence, an array, or rows (sequences) that follow one another."""
        count = len(values) if shape is None else math.prod(shape)
        start = self._reserve(name, count, shape)
        if isinstance(values, np.ndarray):
            self._ints[start:self._used] = values.reshape(-1)
            return
        flat: Iterable[object] = values
        if count and not isinstance(values[0], int | np.generic):  # rows
            rows = cast("Sequence[Sequence[int]]", values)
            assert sum(map(len, rows)) == count, f"section {name}: rows do not fill {shape}"
            flat = itertools.chain.from_iterable(rows)
        # fromiter: 3x faster than numpy's conversion of nested lists (~30 us a step at batch 32)
        self._ints[start:self._used] = np.fromiter(flat, dtype=np.int64, count=count)

    def put_floats(self, name: str, values: Sequence[float] | Sequence[Sequence[float]],
                   shape: tuple[int, ...] | None = None) -> None:
        """Append floats under `name`; their device view is float64."""
        count = len(values) if shape is None else math.prod(shape)
        start = self._reserve(name, count, shape, floats=True)
        self._floats[start:self._used] = values if shape is None else np.reshape(values, -1)

    def upload(self) -> dict[str, torch.Tensor]:
        """The one host-to-device copy of the step; views of the device buffer by name."""
        if self.dev is not self.host:
            self.dev[:self._used].copy_(self.host[:self._used], non_blocking=True)
            if self.device.type == "cuda":
                self._uploaded = torch.cuda.Event()
                self._uploaded.record()
        views = {}
        for name, (start, shape, floats) in self._sections.items():
            view = self.dev[start:start + math.prod(shape)]
            views[name] = (view.view(torch.float64) if floats else view).view(shape)
        return views

    def _reserve(self, name: str, count: int, shape: tuple[int, ...] | None, *,
                 floats: bool = False) -> int:
        assert name not in self._sections, f"section {name} written twice in one step"
        start = self._used
        if start + count > self.capacity:
            self._grow(start + count)
        self._sections[name] = (start, shape or (count,), floats)
        self._used = start + count
        return start

    def _grow(self, needed: int) -> None:
        capacity = self.capacity
        while capacity < needed:
            capacity *= 2
        logger.debug("step buffer grown to %d entries", capacity)
        written = self._ints[:self._used].copy()
        self._allocate(capacity)
        self._ints[:len(written)] = written
