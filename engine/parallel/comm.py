"""The collectives a sharded model needs, over torch.distributed: NCCL on CUDA, gloo on CPU."""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.parallel.shard import Shard

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT = timedelta(minutes=30)  # loading a large shard from slow storage


class Collectives:
    """all_reduce for row-parallel outputs, gather_vocab for logits, agree_min for start-up."""

    def __init__(self, shard: Shard, device: torch.device) -> None:
        self.shard = shard
        self.device = device

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's x, in place."""
        dist.all_reduce(x)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[S, vocab_rows] per rank → [S, vocab_size] on every rank (padding columns cut)."""
        parts = [torch.empty_like(logits) for _ in range(self.shard.size)]
        dist.all_gather(parts, logits.contiguous())
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    def agree_min(self, value: int) -> int:
        """The smallest `value` over the ranks (start-up: the KV budget every rank can hold)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def serving_timeout(self, seconds: float) -> None:
        """From now on a collective that waits more than `seconds` for a peer raises: the peer
        is taken for hung (a step's ranks compute equal shares, so a healthy peer is never far
        behind)."""
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))

    def agree_all(self, ok: bool) -> bool:
        """True only if every rank says so (start-up checks that must agree)."""
        return self.agree_min(int(ok)) == 1


def init_group(shard: Shard, device: torch.device, store_path: str) -> Collectives:
    """Join the ranks through a file store on this host; returns this rank's collectives.
    Until serving_timeout() a collective may wait STARTUP_TIMEOUT for a peer (ranks start
    Python and load their shards at their own pace)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store_path}", rank=shard.rank,
                            world_size=shard.size, timeout=STARTUP_TIMEOUT)
    logger.info("tensor parallel: rank %d of %d joined (%s)", shard.rank, shard.size, backend)
    return Collectives(shard, device)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
