"""ModelSpec: facts about the loaded model that the engine sizes itself by."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from engine.parallel.shard import Shard


@dataclass(frozen=True)
class ModelSpec:
    """Read from config.json by the model class; the KV pool and the runner are shaped by it."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    sliding_window: int | None
    # LongRoPE (Phi-3): a sequence longer than this attends with the long factors at every
    # position, as transformers does (which recomputes the cache when a sequence crosses it).
    rope_long_after: int | None = None
    # Each layer's window where they differ (Gemma 2/3, Qwen with max_window_layers); None:
    # every layer has sliding_window.
    layer_windows: tuple[int | None, ...] | None = None

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each layer's window (None: full attention)."""
        return self.layer_windows or (self.sliding_window,) * self.num_layers

    def of_rank(self, shard: Shard) -> ModelSpec:
        """What `shard`'s rank holds: its q heads and its KV heads (vocab_size stays whole)."""
        return replace(self, num_heads=len(shard.split(self.num_heads)),
                       num_kv_heads=len(shard.kv_heads(self.num_heads, self.num_kv_heads)))

    def kv_bytes_per_token(self, dtype: torch.dtype, layers: int | None = None) -> int:
        """K and V of one token over all layers (or over `layers` of them)."""
        count = self.num_layers if layers is None else layers
        return 2 * count * self.num_kv_heads * self.head_dim * dtype.itemsize
