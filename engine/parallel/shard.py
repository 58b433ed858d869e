"""Which part of a Megatron-sharded model one rank holds. Pure Python: the loader asks it which
slice of each checkpoint tensor to read, the model which widths to build.

Column-parallel q/k/v and gate/up split their output rows by head (or by intermediate row);
row-parallel o and down split their input columns the same way and are summed by one all-reduce
each; the embedding and the LM head split the vocabulary. KV heads are split like q heads, or
replicated when there are fewer KV heads than ranks (each rank keeps the one its q heads read).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size` (0 of 1: the whole model)."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.size, f"rank {self.rank} of {self.size}"

    @property
    def is_whole(self) -> bool:
        return self.size == 1

    def check(self, num_heads: int, num_kv_heads: int,
              intermediate_size: int | None = None) -> None:
        """ValueError naming what does not divide by the degree (the MLP's rows too where
        `intermediate_size` is given)."""
        n = self.size
        problems = []
        if num_heads % n:
            problems.append(f"{num_heads} attention heads")
        if num_kv_heads % n and n % num_kv_heads:
            problems.append(f"{num_kv_heads} KV heads (must divide or be divided by it)")
        if intermediate_size is not None and intermediate_size % n:
            problems.append(f"intermediate_size {intermediate_size}")
        if problems:
            raise ValueError(f"invalid tensor_parallel_degree={n}: the model's "
                             f"{', '.join(problems)} do not split across {n} ranks")

    def split(self, total: int) -> range:
        """This rank's equal share of `total` rows (heads, intermediate rows)."""
        part = total // self.size
        return range(self.rank * part, (self.rank + 1) * part)

    def kv_heads(self, num_heads: int, num_kv_heads: int) -> range:
        """The KV heads this rank keeps: its share, or the one head its q heads read."""
        if num_kv_heads % self.size == 0:
            return self.split(num_kv_heads)
        first_q = self.split(num_heads).start
        head = first_q // (num_heads // num_kv_heads)
        return range(head, head + 1)

    def vocab_rows(self, vocab_size: int) -> int:
        """Rows of each rank's vocabulary slice: the vocabulary padded to a multiple of size."""
        return -(-vocab_size // self.size)

    def vocab(self, vocab_size: int) -> range:
        """The token ids this rank's embedding and LM head rows stand for (the last rank's
        padding rows stand for none)."""
        rows = self.vocab_rows(vocab_size)
        start = min(self.rank * rows, vocab_size)
        return range(start, min(start + rows, vocab_size))


def rows_of_heads(heads: range, head_dim: int) -> slice:
    """The rows (or columns) of a projection that belong to `heads`."""
    return slice(heads.start * head_dim, heads.stop * head_dim)
