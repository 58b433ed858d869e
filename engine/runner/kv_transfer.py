"""A sequence's K/V out of the pool and into another pool (disaggregated prefill/decode):
gathered and scattered through its block tables, one layer at a time. Called by the runner."""

from __future__ import annotations

import torch

from engine.kv.layout import KVLayout
from engine.sequence import Sequence


def table_slots(seq: Sequence, block_size: int, start: int, end: int,
                device: torch.device) -> list[torch.Tensor]:
    """Per block table, the pool slots of positions start..end-1 of `seq` ([end - start] int64
    each). A windowed table's slid-past positions name the scratch block: their K/V is read as
    garbage and never attended (a receiver places none there: BlockManager.allocate_placed)."""
    positions = torch.arange(start, end)  # [n]
    slots = []
    for table in seq.block_tables:
        blocks = torch.tensor(table, dtype=torch.int64)[positions // block_size]
        slots.append((blocks * block_size + positions % block_size).to(device))
    return slots


def export_kv(kv_cache: torch.Tensor, layout: KVLayout, seq: Sequence, block_size: int,
              end: int, start: int = 0) -> torch.Tensor:
    """[layers, 2, end - start, Hkv, D]: positions start..end-1 of `seq`, by layer."""
    slots = table_slots(seq, block_size, start, end, kv_cache.device)
    return torch.stack([kv_cache[tensor][:, slots[table]] for tensor, table
                        in zip(layout.layer_tensors, layout.layer_tables, strict=True)])


def import_kv(kv_cache: torch.Tensor, layout: KVLayout, seq: Sequence, block_size: int,
              start: int, kv: torch.Tensor, kv_start: int = 0) -> None:
    """Write `kv` ([layers, 2, n, Hkv, D], positions kv_start..kv_start+n-1) into the blocks of
    `seq` from position `start` on (a prefix cache hit may already hold the earlier ones)."""
    end = kv_start + kv.shape[2]
    if start >= end:
        return
    slots = table_slots(seq, block_size, start, end, kv_cache.device)
    part = kv[:, :, start - kv_start:].to(kv_cache.device, kv_cache.dtype)
    tables = zip(layout.layer_tensors, layout.layer_tables, strict=True)
    for layer, (tensor, table) in enumerate(tables):
        kv_cache[tensor][:, slots[table]] = part[layer]
