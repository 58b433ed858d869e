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
from typing import Protocol, cast

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
    # [num_tokens, context_len] bool; None: plain causal (no prefix), or not built (a backend
    # that bounds rows by position and window: AttentionBackend.reads_prefill_mask)
    mask: torch.Tensor | None


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs about one step; built once by the runner, read by all layers."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V is written
    page_size: int
    decode_token_idx: torch.Tensor | None  # [num_decodes] int64: packed rows with one query
    decode_pages: torch.Tensor | None  # [num_decodes, max_pages] int64, padded
    # [num_decodes, 1, 1, max_pages * page_size] bool: visible; None where the backend does not
    # read it (decode_visible builds it from decode_ctx and decode_lo when asked)
    decode_mask: torch.Tensor | None
    prefills: tuple[PrefillRow, ...]
    backend: AttentionBackend
    # Keys each decode row sees (its context length), in decode_token_idx order.
    decode_context_lens: tuple[int, ...] = ()
    decode_ctx: torch.Tensor | None = None  # [num_decodes] int64: decode_context_lens
    decode_lo: torch.Tensor | None = None  # [num_decodes] int64: first visible position
    decode_order: torch.Tensor | None = None  # [num_decodes] int64: rows by ascending context
    # What the backend derived from this metadata once per step (shared by every layer).
    backend_state: object | None = None
    # The window its masks describe (None: every earlier position).
    window: int | None = None
    # Models whose layers attend within different windows (Gemma 2/3, Qwen with
    # max_window_layers) or keep their KV in different block tables (engine/kv/layout.py):
    # the metadata of every attention group, and each layer's group.
    groups: tuple[AttentionMetadata, ...] | None = None
    layer_groups: tuple[int, ...] | None = None
    # Cooperative prefill (engine/disagg/runahead.py): another worker's K/V arrives before each
    # layer and this step's goes on after it. None: the pool holds all a step reads.
    kv_exchange: LayerExchange | None = None

    def for_layer(self, layer: int, window: int | None) -> AttentionMetadata:
        """What layer number `layer`, attending within `window`, reads and writes."""
        if self.groups is None:
            mine = self
        else:
            assert self.layer_groups is not None  # set together with groups
            mine = self.groups[self.layer_groups[layer]]
        assert window == mine.window, f"layer {layer} (window {window}) read window {mine.window}"
        return mine


class LayerExchange(Protocol):
    """K/V that crosses to or from another process between a step's layers."""

    def before_layer(self, layer: int) -> None:
        """Before layer number `layer` runs: what it must read is in the pool when this returns."""

    def after_layer(self, layer: int) -> None:
        """Layer number `layer` has written its K/V to the pool."""


class AttentionBackend(ABC):
    """How attention reads the pool. Every backend must match the reference within dtype
    tolerance; the runner calls prepare() once per step and every layer calls forward()."""

    name: str
    # Whether forward() reads AttentionMetadata.decode_mask: the runner builds it only then
    # (a few tensor ops per step that a kernel reading contexts and page tables never needs).
    reads_decode_mask = True
    # Whether forward() reads PrefillRow.mask: built only then (a few tensor ops per prompt
    # row with a prefix or a window, on the host's critical path of a GPU step).
    reads_prefill_mask = True
    # (max_rows, pytree types) of the latest warm-up (engine/runner/attention_check.py);
    # None: none
    warmed_up: tuple[int, int] | None = None
    # Whether forward() takes logit soft-capping (Gemma 2); other backends are given None and
    # such layers use engine/attention/explicit.py
    caps_scores = False
    # Whether padded decode graphs may call it on the pool's own page tables (it bounds rows by
    # context and first visible position, reading only what they see): the reference's gather
    # runs there otherwise
    reads_pool_in_place = False

    def prepare(self, meta: AttentionMetadata) -> object | None:
        return None

    @abstractmethod
    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float,
                softcap: float | None = None) -> torch.Tensor:
        """q [num_tokens, num_heads, head_dim] → out [num_tokens, num_heads, head_dim];
        `softcap` only where caps_scores."""


@dataclass(frozen=True)
class DecodeGroup:
    """Single-query rows attended together, padded to the longest of them."""

    token_idx: torch.Tensor  # [n] int64: their packed rows
    pages: torch.Tensor  # [n, width] int64
    mask: torch.Tensor  # [n, 1, 1, width * page_size] bool: visible


class ReferenceAttention(AttentionBackend):
    """Gather pages + SDPA: any device, any block size. The truth in tests."""

    name = "reference"

    def prepare(self, meta: AttentionMetadata) -> tuple[DecodeGroup, ...]:
        return decode_groups(meta)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float,
                softcap: float | None = None) -> torch.Tensor:
        assert softcap is None, "caps_scores is False"
        groups = cast("tuple[DecodeGroup, ...] | None", meta.backend_state)  # from prepare()
        return reference_attention(q, k_cache, v_cache, meta, scale, groups)


# A group costs about this many (row x page) cells of padding in fixed per-call overhead
# (cells of page_size tokens: with smaller pages a cut pays off at fewer padding tokens).
GROUP_COST = 32
MAX_DECODE_GROUPS = 4


def decode_groups(meta: AttentionMetadata) -> tuple[DecodeGroup, ...]:
    """The decode rows split by context length, so short rows are not padded to the longest:
    gathering and attending to padding is most of decode attention's cost when lengths vary."""
    if meta.decode_token_idx is None:
        return ()
    assert meta.decode_pages is not None  # set with decode_token_idx
    mask = decode_visible(meta)
    whole = DecodeGroup(meta.decode_token_idx, meta.decode_pages, mask)
    lens = meta.decode_context_lens
    if len(lens) != len(meta.decode_token_idx):
        return (whole,)
    widths = sorted(-(-n // meta.page_size) for n in lens)  # pages each row needs, ascending
    bounds = split_by_width(widths, GROUP_COST, MAX_DECODE_GROUPS)
    if len(bounds) == 2 or meta.decode_order is None:
        return (whole,)
    groups = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        rows = meta.decode_order[start:end]  # the runner sorted them, on the device already
        width = widths[end - 1]
        groups.append(DecodeGroup(meta.decode_token_idx.index_select(0, rows),
                                  meta.decode_pages.index_select(0, rows)[:, :width],
                                  mask.index_select(0, rows)[..., :width * meta.page_size]))
    return tuple(groups)


def decode_visible(meta: AttentionMetadata) -> torch.Tensor:
    """[B, 1, 1, max_pages * page_size] bool: the positions each decode row sees (the
    metadata's decode_mask, or built from its contexts and first visible positions)."""
    if meta.decode_mask is not None:
        return meta.decode_mask
    # set with decode_token_idx (engine/runner/step_metadata.py)
    assert meta.decode_pages is not None and meta.decode_ctx is not None
    assert meta.decode_lo is not None
    width = meta.decode_pages.shape[1] * meta.page_size
    pos = torch.arange(width, device=meta.decode_ctx.device)  # [T]
    return visible_positions(pos, meta.decode_ctx, meta.decode_lo)


def visible_positions(pos: torch.Tensor, ctx: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """pos [T] (or each row's [B, T]), ctx and lo [B] → [B, 1, 1, T] bool: each row sees its
    positions lo <= p < ctx."""
    return ((pos < ctx[:, None]) & (pos >= lo[:, None]))[:, None, None, :]


def split_by_width(widths: list[int], group_cost: int, max_groups: int) -> list[int]:
    """Boundaries [0, ..., n] cutting ascending `widths` into groups, each padded to its last
    width; greedily the cut that saves the most padded cells, while it saves > `group_cost`."""
    bounds = [0, len(widths)]
    while len(bounds) - 1 < max_groups:
        best, cut = group_cost, None
        for start, end in zip(bounds, bounds[1:], strict=False):
            for c in range(start + 1, end):
                saved = (c - start) * (widths[end - 1] - widths[c - 1])
                if saved > best:
                    best, cut = saved, c
        if cut is None:
            return bounds
        bounds = sorted([*bounds, cut])
    return bounds


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
                        meta: AttentionMetadata, scale: float,
                        groups: tuple[DecodeGroup, ...] | None = None) -> torch.Tensor:
    """q [num_tokens, num_heads, head_dim] → out [num_tokens, num_heads, head_dim]."""
    out = torch.empty_like(q)
    if groups is None and meta.decode_token_idx is not None:
        assert meta.decode_pages is not None  # set with decode_token_idx
        groups = (DecodeGroup(meta.decode_token_idx, meta.decode_pages, decode_visible(meta)),)
    decode_reference(q, k_cache, v_cache, meta.page_size, scale, groups or (), out)
    prefill_attention(q, k_cache, v_cache, meta, scale, out)
    return out


def decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     page_size: int, scale: float, groups: tuple[DecodeGroup, ...],
                     out: torch.Tensor) -> None:
    """Fills the single-query rows of `out`: one batched SDPA per group over gathered KV."""
    num_heads, kv_heads = q.shape[1], k_cache.shape[1]
    for group in groups:
        # The query heads sharing a KV head go in as that head's queries (all see the same
        # keys): SDPA then reads each K/V row once per KV head, not once per query head (~25 %
        # faster on CPU than enable_gqa).
        n = group.token_idx.numel()
        qd = q.index_select(0, group.token_idx).view(n, kv_heads, num_heads // kv_heads, -1)
        kd = gather_pages(k_cache, group.pages, page_size).transpose(1, 2)  # [B, Hkv, T, D]
        vd = gather_pages(v_cache, group.pages, page_size).transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=group.mask, scale=scale)
        out.index_copy_(0, group.token_idx, od.reshape(n, num_heads, -1))


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
    """Fills the rows of `out` that belong to prefills (prompts or chunks of them)."""
    g = meta.page_size
    for row in meta.prefills:
        end = row.token_start + row.num_tokens
        # NOTE: 4-D with a batch of one: on CPU, 3-D inputs miss the flash kernel and take
        # SDPA's math path, 3-4x slower for a 512-token chunk.
        qp = q[row.token_start:end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        kp = gather_pages(k_cache, row.kv_pages, g)[:row.context_len].transpose(0, 1)[None]
        vp = gather_pages(v_cache, row.kv_pages, g)[:row.context_len].transpose(0, 1)[None]
        mask = row.mask if row.mask is not None else causal_mask(  # not built: see it now
            row.num_tokens, row.context_len, meta.window, q.device)
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale,
                                            is_causal=mask is None, enable_gqa=True)
        out[row.token_start:end] = op[0].transpose(0, 1)


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
