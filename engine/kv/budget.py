"""How big the KV pool is: one memory budget for every strategy, turned into blocks."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.kv.allocator import ContiguousAllocator, KVAllocator
from engine.kv.block_manager import BlockManager
from engine.kv.layout import KVLayout, shared_layout

logger = logging.getLogger(__name__)

CPU_KV_FRACTION = 0.3  # of available RAM, when no budget is configured
GPU_ACTIVATION_RESERVE = 0.05  # of total GPU memory kept for activations and the allocator


@dataclass(frozen=True)
class KVPlan:
    """The pool's shape and what it means for concurrency."""

    num_blocks: int
    block_size: int
    bytes_per_token: int  # of one block id's slot: K and V in each of the layout's tensors
    max_concurrency: int  # sequences of max_model_len tokens that fit at once
    sized_by: str
    layout: KVLayout

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.bytes_per_token


def plan_kv(config: EngineConfig, max_model_len: int, bytes_per_token: int,
            default_budget_bytes: int, layout: KVLayout | None = None) -> KVPlan:
    """Size the pool from num_kv_blocks, kv_cache_memory or the device default, in that order.
    `bytes_per_token`: what one slot of a block id costs (K and V in every pool tensor).

    Contiguous strategies reserve max_model_len tokens per sequence, so the same budget holds
    fewer of them; nobody gets more than max_num_seqs full-length sequences' worth (in every
    block table of the layout).
    """
    layout = layout or shared_layout((None,))
    if config.num_kv_blocks is not None:
        tokens, sized_by = config.num_kv_blocks * config.block_size, "num_kv_blocks"
    elif config.kv_cache_memory is not None:
        tokens, sized_by = config.kv_cache_memory // bytes_per_token, "kv_cache_memory"
    else:
        tokens, sized_by = default_budget_bytes // bytes_per_token, "device default"
    tokens = min(tokens, config.max_num_seqs * max_model_len * layout.num_tables)
    block_size = max_model_len if config.is_contiguous else config.block_size
    num_blocks = tokens // block_size
    pool = {"num_kv_blocks": f"num_kv_blocks={config.num_kv_blocks}",
            "kv_cache_memory": f"kv_cache_memory={config.kv_cache_memory}"}.get(sized_by)
    if num_blocks < 1:  # a configuration error: "invalid <key>=<value>: ..."
        key = "max_model_len" if config.is_contiguous else "block_size"
        raise ValueError(
            f"invalid {key}={block_size}: the KV pool ({pool or sized_by}) holds {tokens} "
            f"tokens, less than one block of {block_size} tokens ({key}); raise "
            f"kv_cache_memory / num_kv_blocks or lower {key}")
    if num_blocks < layout.num_tables:
        raise ValueError(
            f"{f'invalid {pool}' if pool else 'the KV pool (device default)'}: holds "
            f"{num_blocks} blocks, fewer than the {layout.num_tables} block tables of this "
            "model's layer groups (a sequence takes a block in each); raise kv_cache_memory / "
            "num_kv_blocks")
    return KVPlan(num_blocks, block_size, bytes_per_token,
                  max_concurrency(num_blocks, block_size, max_model_len, layout), sized_by,
                  layout)


def max_concurrency(num_blocks: int, block_size: int, max_model_len: int,
                    layout: KVLayout | None = None) -> int:
    """Sequences of max_model_len tokens a pool of num_blocks blocks holds at once (in a
    hybrid layout, windowed tables hold only their window's blocks)."""
    if layout is None or not layout.is_hybrid:
        return num_blocks * block_size // max_model_len
    return num_blocks // layout.blocks_per_sequence(max_model_len, block_size)


def build_allocator(config: EngineConfig, plan: KVPlan) -> KVAllocator:
    """The strategy's allocator over the planned pool: a block table per table of the plan's
    layout, each freeing what sequences slide past where its layers share a window."""
    if config.is_contiguous:
        return ContiguousAllocator(num_slots=plan.num_blocks, max_model_len=plan.block_size)
    return BlockManager(plan.num_blocks, plan.block_size,
                        enable_prefix_caching=config.enable_prefix_caching,
                        table_windows=plan.layout.table_windows,
                        whole_prompts=not config.enable_chunked_prefill)


def default_budget_bytes(device_type: str, gpu_memory_utilization: float) -> int:
    """KV bytes to use when nothing is configured: a share of free RAM, or of the GPU."""
    if device_type == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info()
        target = total * (gpu_memory_utilization - GPU_ACTIVATION_RESERVE)
        return max(0, int(min(free, target - (total - free))))
    import psutil

    return int(psutil.virtual_memory().available * CPU_KV_FRACTION)
