"""Attention over the KV pool, addressed by block tables. The pure-PyTorch reference is the truth.

Pool layout per layer: k_cache, v_cache [num_slots, num_kv_heads, head_dim], where
    slot = block_table[pos // block_size] * block_size + pos % block_size.
Reads gather whole pages of `page_size` consecutive slots (a divisor of block_size): copying
rows of pages is several times faster than gathering slot by slot. The pool is zero-initialised,
so the padding of a partly used page is finite and the mask then hides it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

MAX_PAGE_SIZE = 16


@dataclass(frozen=True)
class PrefillRow:
    """One sequence computing more than one token this step (a prompt or a chunk of it)."""

    token_start: int  # first of its tokens in the packed batch
    num_tokens: int
    context_len: int  # keys visible to its last token: positions 0..context_len-1
    kv_pages: torch.Tensor  # [ceil(context_len / page_size)] int64
    mask: torch.Tensor | None  # [num_tokens, context_len] bool, None = plain causal (no prefix)


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs about one step; built once by the runner, read by all layers."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V is written
    page_size: int
    decode_token_idx: torch.Tensor | None  # [num_decodes] int64: packed rows with one query
    decode_pages: torch.Tensor | None  # [num_decodes, max_pages] int64, padded
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_pages * page_size] bool: visible
    prefills: tuple[PrefillRow, ...]
    backend: AttentionBackend
    # What the backend derived from this metadata once per step (shared by every layer).
    backend_state: object | None = None


class AttentionBackend(ABC):
    """How attention reads the pool. Every backend must match the reference within dtype
    tolerance; the runner calls prepare() once per step and every layer calls forward()."""

    name: str

    def prepare(self, meta: AttentionMetadata) -> object | None:
        return None

    @abstractmethod
    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [num_tokens, num_heads, head_dim] → out [num_tokens, num_heads, head_dim]."""


class ReferenceAttention(AttentionBackend):
    """Gather pages + SDPA: any device, any block size. The truth in tests."""

    name = "reference"

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return reference_attention(q, k_cache, v_cache, meta, scale)


def page_size_for(block_size: int) -> int:
    """The largest divisor of block_size up to MAX_PAGE_SIZE: pages never straddle blocks."""
    return max(d for d in range(1, min(block_size, MAX_PAGE_SIZE) + 1) if block_size % d == 0)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write this step's keys and values ([num_tokens, num_kv_heads, head_dim]) into the pool."""
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


def gather_pages(cache: torch.Tensor, pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """cache [slots, Hkv, D], pages [..., P] → [..., P * page_size, Hkv, D]."""
    _, heads, dim = cache.shape
    rows = cache.view(-1, page_size, heads, dim).index_select(0, pages.reshape(-1))
    return rows.view(*pages.shape[:-1], pages.shape[-1] * page_size, heads, dim)


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [num_tokens, num_heads, head_dim] → out [num_tokens, num_heads, head_dim]."""
    out = torch.empty_like(q)
    g = meta.page_size
    if meta.decode_token_idx is not None:
        # One batched SDPA for every single-query row, over gathered, padded KV.
        qd = q.index_select(0, meta.decode_token_idx).unsqueeze(2)  # [B, H, 1, D]
        kd = gather_pages(k_cache, meta.decode_pages, g).transpose(1, 2)  # [B, Hkv, T, D]
        vd = gather_pages(v_cache, meta.decode_pages, g).transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale,
                                            enable_gqa=True)
        out.index_copy_(0, meta.decode_token_idx, od.squeeze(2))
    for row in meta.prefills:
        end = row.token_start + row.num_tokens
        qp = q[row.token_start:end].transpose(0, 1)  # [H, n, D]
        kp = gather_pages(k_cache, row.kv_pages, g)[:row.context_len].transpose(0, 1)
        vp = gather_pages(v_cache, row.kv_pages, g)[:row.context_len].transpose(0, 1)
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=row.mask, scale=scale,
                                            is_causal=row.mask is None, enable_gqa=True)
        out[row.token_start:end] = op.transpose(0, 1)
    return out


def causal_mask(num_queries: int, context_len: int, sliding_window: int | None,
                device: torch.device) -> torch.Tensor | None:
    """[num_queries, context_len] bool for queries at the last positions; None if plain causal."""
    if num_queries == context_len and sliding_window is None:
        return None
    q_pos = torch.arange(context_len - num_queries, context_len, device=device)[:, None]
    k_pos = torch.arange(context_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask
