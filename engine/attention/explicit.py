"""Attention with the score computed explicitly: logit soft-capping (Gemma 2), which neither
SDPA nor batchyard's kernels take, with the layer's own window. Same pool, pages and metadata as
the reference; slower (the scores are materialised), so only layers that cap their scores use
it (Gemma 2's, native or through the transformers fallback). Layers with windows of their own
read per-window metadata instead.
"""

from __future__ import annotations

import torch

from engine.attention.reference import AttentionMetadata, gather_pages

SCORE_BUDGET = 1 << 24  # float32 scores of one prefill chunk at most (64 MiB)


def explicit_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       meta: AttentionMetadata, scale: float, softcap: float | None,
                       window: int | None) -> torch.Tensor:
    """q [N, H, D] → out [N, H, D]; keys at positions > query position - window are visible
    (transformers' convention), every earlier one when window is None."""
    out = torch.empty_like(q)
    g = meta.page_size
    if meta.decode_token_idx is not None:
        # set with decode_token_idx (engine/runner/step_metadata.py)
        assert meta.decode_pages is not None and meta.decode_ctx is not None
        rows: torch.Tensor | slice = meta.decode_token_idx  # a slice for prefill rows below
        keys = gather_pages(k_cache, meta.decode_pages, g)  # [B, T, Hkv, D]
        values = gather_pages(v_cache, meta.decode_pages, g)
        k_pos = torch.arange(keys.shape[1], device=q.device)[None, :]  # [1, T]
        q_pos = meta.decode_ctx[:, None] - 1  # [B, 1]
        visible = _visible(q_pos, k_pos, window)[:, None, None, :]  # [B, 1, 1, T]
        out[rows] = _attend(q[rows][:, :, None], keys, values, visible, scale, softcap)[:, :, 0]
    for row in meta.prefills:
        keys = gather_pages(k_cache, row.kv_pages, g)[:row.context_len]  # [T, Hkv, D]
        values = gather_pages(v_cache, row.kv_pages, g)[:row.context_len]
        first = row.context_len - row.num_tokens  # position of the row's first query
        # Queries in chunks, each against only the keys it can see: the scores of a long
        # prompt would not fit in memory at once (H x n x T floats).
        step = max(1, SCORE_BUDGET // (q.shape[1] * row.context_len))
        for start in range(0, row.num_tokens, step):
            stop = min(start + step, row.num_tokens)
            lo = 0 if window is None else max(0, first + start - window + 1)
            hi = first + stop  # keys up to the chunk's last query
            k_pos = torch.arange(lo, hi, device=q.device)[None, :]
            q_pos = torch.arange(first + start, first + stop, device=q.device)[:, None]
            visible = _visible(q_pos, k_pos, window)[None, None]  # [1, 1, n, T]
            rows = slice(row.token_start + start, row.token_start + stop)
            queries = q[rows].transpose(0, 1)[None]  # [1, H, n, D]
            out[rows] = _attend(queries, keys[None, lo:hi], values[None, lo:hi], visible, scale,
                                softcap)[0].transpose(0, 1)
    return out


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    return visible


def _attend(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            visible: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    """queries [B, H, n, D]; keys, values [B, T, Hkv, D]; visible broadcast to [B, H, n, T]
    → [B, H, n, D], in float32."""
    heads, kv_heads = queries.shape[1], keys.shape[2]
    k = keys.transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1).float()  # [B, H, T, D]
    v = values.transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1).float()
    scores = queries.float() @ k.transpose(-1, -2) * scale  # [B, H, n, T]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(dim=-1) @ v).to(queries.dtype)
