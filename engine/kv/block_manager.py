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
from typing import cast

from engine.kv.allocator import KVAllocator
from engine.kv.layout import blocks_held
from engine.sequence import Sequence

_BlockKey = tuple[int | None, tuple[int, ...]]  # (parent block hash, this block's token ids)
MAX_SEQ_TOKENS = 1 << 30  # longer than any max_model_len


class BlockManager(KVAllocator):
    """Paged allocator: blocks are taken as sequences grow and returned when they end."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 table_windows: tuple[int | None, ...] = (None,), whole_prompts: bool = True):
        """`table_windows`: per block table, the window its blocks are freed behind (None:
        kept); default one table that keeps them. `whole_prompts`: prompts are prefilled in
        one step (no chunking), so every table holds a whole prompt at once."""
        super().__init__(num_blocks=num_blocks, block_size=block_size)
        self.whole_prompts = whole_prompts
        self.enable_prefix_caching = enable_prefix_caching
        self.table_windows = tuple(table_windows)
        self.num_tables = len(self.table_windows)
        self.any_window = any(w is not None for w in self.table_windows)
        self.outside_window = num_blocks  # the runner's scratch block: never allocated
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # block id -> (its table, hash of its key): each table caches its own blocks
        self._hash_of: dict[int, tuple[int, int]] = {}
        self._key_of: dict[int, _BlockKey] = {}
        self._block_by_hash: dict[tuple[int, int], int] = {}
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
        if self.whole_prompts or not self.any_window:
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
            table.extend(self._taken() for _ in range(need))

    def allocate_placed(self, seq: Sequence, num_tokens: int, placed: int) -> bool:
        """Blocks for a sequence that holds none yet, whose first `placed` tokens' KV comes from
        elsewhere (disaggregated workers) and which then computes up to `num_tokens`: a
        windowed table takes none for the positions the query at `placed` no longer sees (their
        entries name the scratch block, as if slid past). False, taking nothing, when the free
        blocks do not suffice."""
        assert not seq.block_table, "placed KV starts from an empty table"
        total = -(-num_tokens // self.block_size)
        skipped = [0 if window is None else
                   min(total, max(0, placed - window + 1) // self.block_size)
                   for window in self.table_windows]
        if sum(total - n for n in skipped) > self.num_free_blocks:
            return False
        seq.block_tables = [[self.outside_window] * n
                            + [self._taken() for _ in range(total - n)] for n in skipped]
        return True

    def _taken(self) -> int:
        block = self._take_free_block()
        self._ref[block] = 1
        return block

    def release_outside_window(self, seq: Sequence) -> None:
        """Give back the blocks whose positions no later query of `seq` can see: the next one
        (at position num_computed_tokens) sees positions > num_computed_tokens - window.
        Proposals may be rejected: only the computed tokens before them count."""
        computed = seq.num_computed_tokens - seq.num_drafts
        for window, table in zip(self.table_windows, seq.block_tables, strict=False):
            if window is None:
                continue
            first_visible = computed - window + 1
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
        A full-attention table needs every matched block cached; a windowed one only those its
        next query can see (the rest of its entries name the scratch block, as if slid past).
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return 0
        cached, hashes = self._cached_prompt(seq)
        matched = self._longest_match(cached)
        self.prefix_queries += min(matched + 1, (seq.num_tokens - 1) // self.block_size)
        self.prefix_hits += matched
        # Every block the next query sees is cached (not None): _longest_match chose so.
        seq.block_tables = [
            [self._share(cast(int, blocks[i])) if i >= self._first_seen(matched, window)
             else self.outside_window for i in range(matched)]
            for blocks, window in zip(cached, self.table_windows, strict=True)]
        seq.num_computed_tokens = matched * self.block_size
        self._hashed[seq.seq_id] = (matched, hashes[matched - 1] if matched else _root(seq))
        return seq.num_computed_tokens

    def _cached_prompt(self, seq: Sequence) -> tuple[list[list[int | None]], list[int]]:
        """Each table's cached block (None: not cached) for the leading full prompt blocks but
        a last token's, and their hashes; the walk ends where a full-attention table misses (no
        match reaches past that)."""
        full = [t for t, window in enumerate(self.table_windows) if window is None]
        cached: list[list[int | None]] = [[] for _ in self.table_windows]
        hashes: list[int] = []
        parent, bs = _root(seq), self.block_size
        for i in range((seq.num_tokens - 1) // bs):
            key = (parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            parent = hash(key)
            found = [self._cached(t, parent, key) for t in range(self.num_tables)]
            if any(found[t] is None for t in full):
                break
            hashes.append(parent)
            for blocks, block in zip(cached, found, strict=True):
                blocks.append(block)
        return cached, hashes

    def _cached(self, table: int, block_hash: int, key: _BlockKey) -> int | None:
        block = self._block_by_hash.get((table, block_hash))
        return block if block is not None and self._key_of[block] == key else None

    def _first_seen(self, matched: int, window: int | None) -> int:
        """The first of `matched` blocks the next query (at matched * block_size) can see."""
        if window is None:
            return 0
        return max(0, (matched * self.block_size - window + 1) // self.block_size)

    def _longest_match(self, cached: list[list[int | None]]) -> int:
        """The most leading prompt blocks every windowed table has the visible ones of (the
        full tables have all of them: the walk stopped at their first miss)."""
        runs = []  # per windowed table: cached blocks in a row ending at each block
        for blocks, window in zip(cached, self.table_windows, strict=True):
            if window is not None:
                run, length = [], 0
                for block in blocks:
                    length = length + 1 if block is not None else 0
                    run.append(length)
                runs.append((window, run))
        for matched in range(len(cached[0]), 0, -1):
            if all(run[matched - 1] >= matched - self._first_seen(matched, window)
                   for window, run in runs):
                return matched
        return 0

    def _share(self, block: int) -> int:
        if self._ref[block] == 0:
            del self._evictable[block]
        self._ref[block] += 1
        return block

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish the sequence's newly completed blocks in the prefix cache (each table's under
        its own key; a block already slid out of a window is gone)."""
        if not self.enable_prefix_caching:
            return
        done, parent = self._hashed.get(seq.seq_id, (0, _root(seq)))
        # Only blocks whose token ids are all known (none pending on the device) get a key.
        known = min(seq.num_computed_tokens, seq.num_verified_tokens)  # (never a proposal)
        full = min(known // self.block_size, len(seq.block_table))
        for i in range(done, full):
            key = (parent, tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size]))
            parent = hash(key)
            for table, blocks in enumerate(seq.block_tables):
                block = blocks[i]
                # An identical block may be cached already (same prefix computed twice): keep
                # that one.
                if (block != self.outside_window and (table, parent) not in self._block_by_hash
                        and block not in self._hash_of):
                    self._block_by_hash[(table, parent)] = block
                    self._hash_of[block] = (table, parent)
                    self._key_of[block] = key
        if full > done:
            self._hashed[seq.seq_id] = (full, parent)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: cached blocks become free, live ones lose their keys (their
        sequences publish them again as they grow). For KV that cannot be trusted, e.g. a failed
        step's, which an ended sequence may already have left in the cache."""
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._hash_of.clear()
        self._key_of.clear()
        self._block_by_hash.clear()
        self._hashed.clear()

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


def _root(seq: Sequence) -> int | None:
    """The parent of a sequence's first block: its LoRA adapter's (the same prompt under two
    adapters has different KV, so their blocks must never be shared), or None."""
    return None if seq.lora_key is None else hash(("lora", seq.lora_key))
