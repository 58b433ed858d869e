"""KV-Runahead: one long prompt prefilled by several workers at once.

The prompt is cut into contiguous slices, one per prefill worker, later slices shorter since
their tokens attend to more. Worker i computes its slice in one step; before each layer it
receives that layer's K/V of every earlier position from worker i - 1 (which computed it one
layer ahead), and after the layer it passes the layer's K/V of every position so far on to
worker i + 1. The workers thus run their slices concurrently, a layer apart, and the last one
samples the first token and hands the whole prompt's KV to a decode worker as usual.

The partition balances each slice's work (engine/disagg/partition.py); `bench runahead`
measures what it buys."""

from __future__ import annotations

from engine.inputs import CooperativeSlice
from engine.runner.kv_transfer import table_slots
from engine.runner.model_runner import ModelRunner
from engine.sequence import Sequence

FIRST_TAG = 2  # tags below are the hand-offs'
MAX_TAGS = 1 << 30


class LayerStream:
    """A cooperative slice's leading K/V, arriving during its step (an engine's RemoteKV)."""

    def __init__(self, wire, slice_: CooperativeSlice) -> None:
        self.wire = wire
        self.slice = slice_

    def place(self, runner: ModelRunner, seq: Sequence, start: int) -> None:
        runner.use_exchange(RunaheadExchange(runner, self.wire, seq, start, self.slice))


class RunaheadExchange:
    """One cooperative step's trade with the neighbouring workers, layer by layer (a
    LayerExchange): receive positions start..slice_start-1, send 0..len(prompt)-1."""

    def __init__(self, runner: ModelRunner, wire, seq: Sequence, start: int,
                 slice_: CooperativeSlice) -> None:
        self.runner, self.wire, self.slice = runner, wire, slice_
        self.start = start
        self.tag = FIRST_TAG + slice_.coop_id % MAX_TAGS
        device = runner.kv_cache.device
        self.tables = runner.layout.layer_tables
        self.recv_slots = table_slots(seq, runner.block_size, start, slice_.slice_start, device)
        end = len(slice_.request.prompt_token_ids)
        self.send_slots = table_slots(seq, runner.block_size, 0, end, device)
        self.sends: list = []

    def before_layer(self, layer: int) -> None:
        prev = self.slice.prev_rank
        if prev is None:
            return
        cache = self.runner.layer_caches[layer]  # [2, slots, Hkv, D]
        shape = (2, self.slice.slice_start, cache.shape[2], cache.shape[3])
        kv = self.wire.recv(shape, cache.dtype, prev, self.tag)  # positions 0..slice_start-1
        slots = self.recv_slots[self.tables[layer]]
        cache[:, slots] = kv[:, self.start:].to(cache.device)

    def after_layer(self, layer: int) -> None:
        nxt = self.slice.next_rank
        if nxt is not None:
            cache = self.runner.layer_caches[layer]
            kv = cache[:, self.send_slots[self.tables[layer]]].to(self.wire.device)
            self.sends.append((self.wire.isend(kv, nxt, self.tag), kv))
        if layer == len(self.tables) - 1:  # the step is done only once its K/V is out
            for work, _ in self.sends:
                work.wait()
            self.sends.clear()
