"""KVLayout: which block table and which pool tensor each layer's K/V use. Pure Python.

Models whose layers attend within different windows (Gemma 2/3, Qwen with max_window_layers)
need not keep every position's KV in every layer: a windowed layer only ever reads the last
`window` positions. Under paged batching the layers are split into
attention groups of equal size, each with its own block table, all drawing block ids from one
pool (vLLM's hybrid allocator): the windowed groups' tables give back what their sequences slide
past, while the full-attention groups keep everything. A block id then stands for the same slots
in `group size` pool tensors, and the j-th layer of every group lives in tensor j, so no block's
memory is idle whichever group holds it.

Elsewhere (contiguous strategies, one window for every layer) a sequence has one block table and
every layer its own tensor; layers with different windows still read their own masks (one
attention group per window).
"""

from __future__ import annotations

from dataclasses import dataclass

# Most block tables a sequence gets: each costs one slot mapping and page table per step.
MAX_TABLES = 8


@dataclass(frozen=True)
class KVLayout:
    """Attention groups (a window and a block table each) and, per layer, its group and the
    pool tensor its K/V live in."""

    group_windows: tuple[int | None, ...]  # per group: its layers' window (None: full)
    group_tables: tuple[int, ...]  # per group: which of a sequence's block tables it reads
    layer_groups: tuple[int, ...]  # per layer
    layer_tensors: tuple[int, ...]  # per layer: its index in the pool's first dimension

    def __post_init__(self) -> None:
        assert len(self.group_windows) == len(self.group_tables) >= 1
        assert len(self.layer_groups) == len(self.layer_tensors) >= 1
        assert set(self.layer_groups) == set(range(len(self.group_windows)))
        assert set(self.group_tables) == set(range(self.num_tables))
        pairs = list(zip(self.layer_groups, self.layer_tensors, strict=True))
        assert len(set(pairs)) == len(pairs), "two layers of a group share a tensor"
        if self.num_tables == 1:
            assert len(set(self.layer_tensors)) == len(pairs), "one table: a tensor per layer"

    @property
    def num_tables(self) -> int:
        return max(self.group_tables) + 1

    @property
    def num_tensors(self) -> int:
        return max(self.layer_tensors) + 1

    @property
    def is_hybrid(self) -> bool:
        """Several block tables: windowed groups bound the KV they keep."""
        return self.num_tables > 1

    @property
    def layer_tables(self) -> tuple[int, ...]:
        """Per layer, which of a sequence's block tables holds its K/V."""
        return tuple(self.group_tables[g] for g in self.layer_groups)

    @property
    def table_windows(self) -> tuple[int | None, ...]:
        """Per block table, the window its blocks are freed behind (None: never freed). A table
        read by a full-attention group keeps everything."""
        windows: list[int | None] = []
        for table in range(self.num_tables):
            read_by = {w for w, t in zip(self.group_windows, self.group_tables, strict=True)
                       if t == table}
            windows.append(None if None in read_by or len(read_by) > 1 else read_by.pop())
        return tuple(windows)

    def blocks_per_sequence(self, tokens: int, block_size: int) -> int:
        return blocks_held(self.table_windows, tokens, block_size)


def blocks_held(table_windows: tuple[int | None, ...], tokens: int, block_size: int) -> int:
    """Blocks one sequence of `tokens` tokens holds at most between steps, over its tables,
    when its prompt is prefilled in chunks (a windowed table: the blocks the next query's
    window spans, its own position included; the rest were given back after the last step)."""
    full = -(-tokens // block_size)
    total = 0
    for window in table_windows:
        span = full if window is None else -(-(window - 1) // block_size) + 1
        total += min(full, span)
    return total


def shared_layout(windows: tuple[int | None, ...]) -> KVLayout:
    """One block table; a tensor per layer; one attention group per distinct window."""
    distinct = list(dict.fromkeys(windows))
    return KVLayout(group_windows=tuple(distinct), group_tables=(0,) * len(distinct),
                    layer_groups=tuple(distinct.index(w) for w in windows),
                    layer_tensors=tuple(range(len(windows))))


def hybrid_layout(windows: tuple[int | None, ...]) -> KVLayout:
    """Each window's layers in groups of the same size (the fewest layers any window has, or
    more so that there are at most MAX_TABLES groups), each group its own block table; layer j
    of a group in tensor j. The last group of a window may be short (its spare tensors idle)."""
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        by_window.setdefault(window, []).append(layer)
    size = min(len(layers) for layers in by_window.values())
    while sum(-(-len(layers) // size) for layers in by_window.values()) > MAX_TABLES:
        size += 1
    group_windows: list[int | None] = []
    layer_groups, layer_tensors = [0] * len(windows), [0] * len(windows)
    for window, layers in by_window.items():
        for start in range(0, len(layers), size):
            for j, layer in enumerate(layers[start:start + size]):
                layer_groups[layer], layer_tensors[layer] = len(group_windows), j
            group_windows.append(window)
    return KVLayout(tuple(group_windows), tuple(range(len(group_windows))),
                    tuple(layer_groups), tuple(layer_tensors))


def kv_layout(windows: tuple[int | None, ...], paged: bool, max_model_len: int,
              block_size: int) -> KVLayout:
    """The layout for a model whose layers have `windows`: hybrid where windows differ, the
    pool is paged and a sequence of max_model_len tokens then takes less memory (a few
    windowed layers among many full ones would pay more for padded groups than they save)."""
    shared = shared_layout(windows)
    if not paged or len(set(windows)) == 1:
        return shared
    hybrid = hybrid_layout(windows)
    cost = {layout: layout.blocks_per_sequence(max_model_len, block_size) * layout.num_tensors
            for layout in (shared, hybrid)}  # layer-blocks one long sequence holds
    return hybrid if cost[hybrid] < cost[shared] else shared
