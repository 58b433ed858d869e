"""BlockManager: paged KV blocks on demand, reference counts and an optional prefix cache.

Pure Python. A block holds `block_size` consecutive tokens of one or more sequences (shared
only through the prefix cache). Block states:
    free       ref 0, no hash             in `_free`
    cached     ref 0, hashed, reusable    in `_evictable` (LRU: evicted oldest first)
    used       ref > 0                    owned by every sequence whose table lists it

A sequence has one block table per KV group (engine/kv/layout.py), all drawing from this pool
and all of the same length. A table whose layers attend to the last `window` positions only
gives back the blocks its sequence has slid past as it grows: their entries then name the pool's
scratch block (`outside_window`), which attention masks out like any padding.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from functools import cached_property

from engine.kv.allocator import KVAllocator
from engine.kv.layout import blocks_held
from engine.sequence import Sequence

_BlockKey = tuple[int | None, tuple[int, ...]]  # (parent block hash, this block's token ids)
MAX_SEQ_TOKENS = 1 << 30  # longer than any max_model_len


class BlockManager(KVAllocator):
    """Paged allocator: blocks are taken as sequences grow and returned when they end."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 sliding_window: int | None = None,
                 table_windows: tuple[int | None, ...] | None = None,
                 whole_prompts: bool = True):
        """`table_windows`: per block table, the window its blocks are freed behind (None:
        kept); default one table with `sliding_window`. `whole_prompts`: prompts are
        prefilled in one step (no chunking), so every table holds a whole prompt at once."""
        super().__init__(num_blocks=num_blocks, block_size=block_size)
        self.whole_prompts = whole_prompts
        self.enable_prefix_caching = enable_prefix_caching
        windows = table_windows or (sliding_window,)
        assert len(windows) == 1 or not enable_prefix_caching, "a cached block is one table's"
        # Prefix caching keeps whole prompts reusable, so it keeps their blocks too.
        self.table_windows = (None,) if enable_prefix_caching else tuple(windows)
        self.num_tables = len(self.table_windows)
        self.outside_window = num_blocks  # the runner's scratch block: never allocated
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_of: dict[int, int] = {}  # block id -> hash of its key
        self._key_of: dict[int, _BlockKey] = {}
        self._block_by_hash: dict[int, int] = {}
        # seq id -> (leading blocks already hashed, hash of the last of them)
        self._hashed: dict[int, tuple[int, int | None]] = {}
        self.prefix_queries = 0  # prompt blocks looked up
        self.prefix_hits = 0  # of which were found

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @cached_property  # fixed at start-up; read for every request's validation
    def max_seq_tokens(self) -> int:
        """The most tokens one sequence can hold here. Prefilled whole, a prompt takes its
        blocks in every table at once; in chunks, a windowed table holds only its window's
        (MAX_SEQ_TOKENS when no length fills the pool: windowed tables only)."""
        if self.whole_prompts or all(w is None for w in self.table_windows):
            return self.num_blocks // self.num_tables * self.block_size
        if blocks_held(self.table_windows, MAX_SEQ_TOKENS, self.block_size) <= self.num_blocks:
            return MAX_SEQ_TOKENS
        low, high = 0, MAX_SEQ_TOKENS  # blocks_held grows with the length: bisect
        while low < high:
            mid = (low + high + 1) // 2
            if blocks_held(self.table_windows, mid, self.block_size) <= self.num_blocks:
                low = mid
            else:
                high = mid - 1
        return low

    def free_slots(self, seq: Sequence) -> int:
        """Token slots `seq` can still write: the rest of its own blocks plus what the free
        blocks give it (each new block position takes one block in every table)."""
        own = len(seq.block_table) * self.block_size - seq.num_computed_tokens
        return own + self.num_free_blocks // self.num_tables * self.block_size

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) * self.num_tables <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        need = self.blocks_needed(seq, num_new_tokens)
        assert need * self.num_tables <= self.num_free_blocks, f"no KV room for {seq}"
        if len(seq.block_tables) < self.num_tables:
            seq.block_tables += [[] for _ in range(self.num_tables - len(seq.block_tables))]
        for table in seq.block_tables:
            for _ in range(need):
                block = self._take_free_block()
                self._ref[block] = 1
                table.append(block)

    def release_outside_window(self, seq: Sequence) -> None:
        """Give back the blocks whose positions no later query of `seq` can see: the next one
        (at position num_computed_tokens) sees positions > num_computed_tokens - window."""
        for window, table in zip(self.table_windows, seq.block_tables, strict=False):
            if window is None:
                continue
            first_visible = seq.num_computed_tokens - window + 1
            for i in range(min(first_visible // self.block_size, len(table))):
                block = table[i]
                if block == self.outside_window:
                    continue
                table[i] = self.outside_window
                self._unref(block)

    def free(self, seq: Sequence) -> None:
        # Tail blocks go first so that LRU eviction drops a prefix's end before its start.
        for table in seq.block_tables:
            for block in reversed(table):
                if block != self.outside_window:
                    self._unref(block)
        seq.block_tables = [[]]
        self._hashed.pop(seq.seq_id, None)

    def _unref(self, block: int) -> None:
        self._ref[block] -= 1
        assert self._ref[block] >= 0
        if self._ref[block] == 0:
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def match_prefix(self, seq: Sequence) -> int:
        """Share cached blocks of a new sequence's prompt; returns tokens now computed.

        At least one prompt token is always left to compute: its logits give the first sample.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return 0
        parent = None
        for i in range((seq.num_tokens - 1) // self.block_size):
            key = (parent, tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size]))
            parent = hash(key)
            block = self._block_by_hash.get(parent)
            self.prefix_queries += 1
            if block is None or self._key_of[block] != key:
                break
            self.prefix_hits += 1
            if self._ref[block] == 0:
                del self._evictable[block]
            self._ref[block] += 1
            seq.block_table.append(block)
        matched = len(seq.block_table)
        seq.num_computed_tokens = matched * self.block_size
        last_hash = self._hash_of[seq.block_table[-1]] if matched else None
        self._hashed[seq.seq_id] = (matched, last_hash)
        return seq.num_computed_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish the sequence's newly completed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        done, parent = self._hashed.get(seq.seq_id, (0, None))
        # Only blocks whose token ids are all known (none pending on the device) get a key.
        known = min(seq.num_computed_tokens, seq.num_known_tokens)
        full = min(known // self.block_size, len(seq.block_table))
        for i in range(done, full):
            block = seq.block_table[i]
            key = (parent, tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size]))
            parent = hash(key)
            # An identical block may be cached already (same prefix computed twice): keep that one.
            if parent not in self._block_by_hash and block not in self._hash_of:
                self._block_by_hash[parent] = block
                self._hash_of[block] = parent
                self._key_of[block] = key
        if full > done:
            self._hashed[seq.seq_id] = (full, parent)

    def check_integrity(self, live_seqs: Iterable[Sequence]) -> None:
        refs = [0] * self.num_blocks
        for seq in live_seqs:
            tables = seq.block_tables
            assert len(tables) in (1, self.num_tables), f"{seq} has {len(tables)} tables"
            assert len({len(t) for t in tables}) == 1, f"{seq}'s tables differ in length"
            for table in tables:
                for block in table:
                    if block != self.outside_window:
                        refs[block] += 1
        assert refs == self._ref, "reference counts disagree with the block tables"
        free, cached = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is free twice"
        assert not free & cached, "a block is both free and cached"
        assert all(self._ref[b] == 0 for b in free | cached), "a free block is referenced"
        used = sum(1 for r in self._ref if r > 0)
        assert len(free) + len(cached) + used == self.num_blocks, "free + cached + used != total"
        assert all(b in self._hash_of for b in cached), "an unhashed block is cached"
        assert {v: k for k, v in self._block_by_hash.items()} == self._hash_of, "hash maps differ"

    def _take_free_block(self) -> int:
        if self._free:
            return self._free.popleft()
        block, _ = self._evictable.popitem(last=False)
        del self._block_by_hash[self._hash_of.pop(block)]
        del self._key_of[block]
        return block
