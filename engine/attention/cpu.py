"""Decode attention on CPU reading the KV pool in place (engine/kernels/paged_decode.c).

At decode, the reference backend's page gather copies every row's KV out of the pool and SDPA
reads the copy again, so attention moves each layer's KV three times; on a 2-core CPU that was
about a third of a paged decode step. FlexAttention's CPU path was 2x slower than the reference
here. The kernel reads each K and V row once, through the page table; the softmax between its
two loops stays in PyTorch. Prefill rows and non-float32 pools take the reference path.
Without a C compiler the backend fails its start-up check and `auto` uses the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from engine.attention.reference import (
    AttentionBackend,
    AttentionMetadata,
    decode_groups,
    decode_reference,
    prefill_attention,
)
from engine.kernels import load_kernels


@dataclass
class DecodeRows:
    """The step's single-query rows, as the kernel reads them."""

    token_idx: torch.Tensor | None  # [B] int64 packed rows; None: rows 0..B-1, the whole batch
    pages: torch.Tensor  # [B, max_pages] int64
    ctx: torch.Tensor  # [B] int64: keys visible end at ctx
    lo: torch.Tensor  # [B] int64: ... and start at lo (> 0 under a sliding window)
    width: int  # longest ctx
    # The reference's decode groups, built by the first layer that needs them (a pool the
    # kernel does not read, e.g. bfloat16) and shared by the others.
    groups: tuple | None = None


class CpuPagedAttention(AttentionBackend):
    """Decode rows through the in-place kernel, prefill rows through the reference."""

    name = "cpu_paged"
    reads_decode_mask = False  # the kernel bounds rows by ctx and lo; the fallback builds it

    def prepare(self, meta: AttentionMetadata) -> DecodeRows | None:
        if meta.decode_token_idx is None:
            return None
        # set with decode_token_idx (engine/runner/step_metadata.py)
        assert meta.decode_pages is not None and meta.decode_ctx is not None
        assert meta.decode_lo is not None
        num_rows = meta.decode_token_idx.numel()
        whole_batch = num_rows == meta.slot_mapping.numel()  # decode-only: rows 0..B-1
        return DecodeRows(
            token_idx=None if whole_batch else meta.decode_token_idx,
            pages=meta.decode_pages.contiguous(), ctx=meta.decode_ctx, lo=meta.decode_lo,
            width=max(meta.decode_context_lens))

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float,
                softcap: float | None = None) -> torch.Tensor:
        assert softcap is None, "caps_scores is False"
        rows = cast("DecodeRows | None", meta.backend_state)  # what prepare() returned
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, as q may not be
        in_place = (k_cache.dtype == torch.float32 and k_cache.is_contiguous()
                    and v_cache.is_contiguous())
        if rows is not None and in_place:
            self._decode(q, k_cache, v_cache, meta.page_size, scale, rows, out)
        elif rows is not None:  # e.g. a bfloat16 pool: the reference's grouped gather + SDPA
            if rows.groups is None:
                rows.groups = decode_groups(meta)
            decode_reference(q, k_cache, v_cache, meta.page_size, scale, rows.groups, out)
        prefill_attention(q, k_cache, v_cache, meta, scale, out)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                page_size: int, scale: float, rows: DecodeRows, out: torch.Tensor) -> None:
        lib = load_kernels()
        qd = q if rows.token_idx is None else q.index_select(0, rows.token_idx)  # [B, H, D]
        qd = qd.contiguous()
        num_rows, num_heads, head_dim = qd.shape
        scores = torch.empty(num_rows, num_heads, rows.width)  # [B, H, T]
        shape = (num_rows, num_heads, k_cache.shape[1], head_dim, page_size,
                 rows.pages.shape[1], rows.width)
        threads = torch.get_num_threads()
        lib.batchyard_decode_scores(qd.data_ptr(), k_cache.data_ptr(), rows.pages.data_ptr(),
                                    rows.ctx.data_ptr(), rows.lo.data_ptr(), scores.data_ptr(),
                                    *shape, scale, threads)
        probs = torch.softmax(scores, dim=-1)
        od = out if rows.token_idx is None else torch.empty_like(qd)  # [B, H, D]
        lib.batchyard_decode_values(probs.data_ptr(), v_cache.data_ptr(), rows.pages.data_ptr(),
                                    rows.ctx.data_ptr(), rows.lo.data_ptr(), od.data_ptr(),
                                    *shape, threads)
        if rows.token_idx is not None:
            out.index_copy_(0, rows.token_idx, od)
