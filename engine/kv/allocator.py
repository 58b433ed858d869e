"""KV allocators: which cache blocks each sequence's tokens live in. Pure Python.

One addressing scheme for every strategy:
    slot = block_table[pos // block_size] * block_size + pos % block_size
The contiguous allocator is the case of one max_model_len-sized block per sequence.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable

from engine.sequence import Sequence


class KVAllocator(ABC):
    """Hands out KV blocks to sequences; query/command pairs keep schedule() readable."""

    enable_prefix_caching = False  # whether finished prompts' blocks are kept for reuse

    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks >= 1 and block_size >= 1
        self.num_blocks = num_blocks
        self.block_size = block_size

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` must gain so that its next `num_new_tokens` tokens have slots."""
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    @property
    @abstractmethod
    def num_free_blocks(self) -> int: ...

    @property
    def max_seq_tokens(self) -> int:
        """The most tokens one sequence can ever hold in this pool."""
        return self.num_blocks * self.block_size

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @abstractmethod
    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether `seq` can get slots for its next `num_new_tokens` tokens."""

    @abstractmethod
    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Extend `seq`'s block tables so its next `num_new_tokens` tokens have slots."""

    @abstractmethod
    def free(self, seq: Sequence) -> None:
        """Return every block of `seq` and clear its block table."""

    @abstractmethod
    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: no later prompt reuses the blocks held now."""

    @abstractmethod
    def check_integrity(self, live_seqs: Iterable[Sequence]) -> None:
        """Raise AssertionError unless free + used == total and block tables match ownership."""


class ContiguousAllocator(KVAllocator):
    """One region of `max_model_len` slots per sequence, reserved whole at admission."""

    def __init__(self, num_slots: int, max_model_len: int) -> None:
        super().__init__(num_blocks=num_slots, block_size=max_model_len)
        self._free: deque[int] = deque(range(num_slots))
        self._owner: dict[int, int] = {}  # block id -> seq id

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def max_seq_tokens(self) -> int:
        return self.block_size

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        if seq.num_computed_tokens + num_new_tokens > self.block_size:
            return False
        return bool(seq.block_table) or bool(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        assert self.can_allocate(seq, num_new_tokens), f"no KV room for {seq}"
        if not seq.block_table:
            block = self._free.popleft()
            self._owner[block] = seq.seq_id
            seq.block_table = [block]

    def free(self, seq: Sequence) -> None:
        for block in seq.block_table:
            assert self._owner.pop(block) == seq.seq_id, f"block {block} not owned by {seq}"
            self._free.append(block)
        seq.block_table = []

    def reset_prefix_cache(self) -> None:
        """Nothing is cached here: a region is freed with its sequence."""

    def check_integrity(self, live_seqs: Iterable[Sequence]) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is free twice"
        assert not free & self._owner.keys(), "a block is both free and used"
        assert len(free) + len(self._owner) == self.num_blocks, "free + used != total"
        held = {}
        for seq in live_seqs:
            assert len(seq.block_table) <= 1, f"{seq} holds more than one contiguous region"
            for block in seq.block_table:
                assert block not in held, f"block {block} held by two sequences"
                held[block] = seq.seq_id
        assert held == self._owner, "block tables disagree with the allocator's owners"
