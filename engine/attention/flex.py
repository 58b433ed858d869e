"""FlexAttention over the KV pool: K/V are read in place, without the reference's gather copy.

The whole pool is one key sequence of num_slots and the step's packed tokens one query sequence.
mask_mod keeps (query, slot) when the slot holds a visible position of the query's own sequence,
looked up in an inverse page table (pool page -> logical page, per sequence); pages shared by
several sequences (prefix cache) are fine. A BlockMask built once per step lists, per block of 16
queries, the KV blocks holding some page of its sequences, so the kernel skips the rest of the
pool. On CUDA FlexAttention compiles to Triton kernels; on CPU to C++ (slow to compile; used to
test this logic).

Recompilation: graphs are compiled per shape (dynamic=False). Query rows are padded to a power
of two and the per-sequence table to a capacity that only grows (the engine reserves
max_num_seqs up front); the pool size is fixed. So steady decoding reuses one graph, and a
server compiles about log2(max tokens per step) graphs: on CUDA all of them at start-up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from engine.attention.reference import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)

_flex_attention = torch.compile(flex_attention, dynamic=False, fullgraph=True)
_RECOMPILE_LIMIT = 64  # query buckets x table capacities; dynamo's default is 8
QUERY_BLOCK = 16  # the BlockMask's query block, also the smallest query bucket


@dataclass
class FlexStep:
    """One step's facts shared by every layer; the first layer adds the BlockMask."""

    num_tokens: int
    q_seq: torch.Tensor  # [Q] int32: the step sequence of each (padded) query row
    q_pos: torch.Tensor  # [Q] int32: its position; -1 on padding rows, which then see nothing
    q_lo: torch.Tensor  # [Q] int32: lowest visible position (> 0 under a sliding window)
    page_seq: torch.Tensor  # [N] int64: sequence of each (sequence, page) pair; capacity: none
    page_ids: torch.Tensor  # [N] int64: the page in the pool
    page_logical: torch.Tensor  # [N] int32: its index in the sequence's page list
    capacity: int  # rows of the per-sequence table (>= number of sequences), a power of two
    block_mask: BlockMask | None = None


class FlexAttention(AttentionBackend):
    """torch FlexAttention reading the pool in place. Any block size; fp32, fp16 or bf16."""

    name = "flex"

    def __init__(self, device: torch.device, kv_block: int = 16) -> None:
        self.kv_block = kv_block
        self.capacity = 16
        # (max_rows, pytree types) of the latest warm-up (engine/attention/check.py); None: none
        self.warmed_up: tuple[int, int] | None = None
        # Triton tiles equal to the BlockMask's blocks, as in vLLM's flex backend: decode rows of
        # many sequences share a query block, so large tiles would mostly compute masked pairs.
        # The main kernel, as vLLM forces too: flex_decoding (auto below 128 query rows) is
        # untried with this mask.
        self.kernel_options = ({"BLOCK_M": QUERY_BLOCK, "BLOCK_N": kv_block, "BACKEND": "TRITON"}
                               if device.type == "cuda" else None)
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, _RECOMPILE_LIMIT)
        # Past the limit dynamo would run flex_attention eagerly, which materialises scores over
        # the whole pool (out of memory on a large GPU pool): fail the step loudly instead.
        torch._dynamo.config.fail_on_recompile_limit_hit = True

    def reserve(self, num_seqs: int) -> None:
        """Size the per-sequence table for `num_seqs` up front: it then never grows, and the
        graphs compiled at start-up serve every step."""
        while self.capacity < num_seqs:
            self.capacity *= 2

    def prepare(self, meta: AttentionMetadata) -> FlexStep:
        device, g = meta.slot_mapping.device, meta.page_size
        num_tokens = meta.slot_mapping.numel()
        rows = max(QUERY_BLOCK, 1 << (num_tokens - 1).bit_length())
        q_seq = torch.zeros(rows, dtype=torch.int32, device=device)  # [Q]
        q_pos = torch.full((rows,), -1, dtype=torch.int32, device=device)  # [Q]
        q_lo = torch.zeros(rows, dtype=torch.int32, device=device)  # [Q]
        seqs, pages, logical = [], [], []
        num_decodes = 0
        if meta.decode_token_idx is not None:
            # Each decode row's mask is one interval of positions ending at its own.
            visible = meta.decode_mask[:, 0, 0, :]  # [B, T] bool
            num_decodes, width = meta.decode_pages.shape
            ends = (visible * torch.arange(1, visible.shape[1] + 1, device=device)).amax(-1)
            rows_at = meta.decode_token_idx
            q_seq[rows_at] = torch.arange(num_decodes, dtype=torch.int32, device=device)
            q_pos[rows_at] = (ends - 1).int()
            q_lo[rows_at] = visible.int().argmax(-1).int()  # first visible position
            j = torch.arange(width, device=device)  # [P]
            padding = j >= (ends[:, None] + g - 1) // g  # [B, P]: past the row's own pages
            owner = torch.arange(num_decodes, device=device)[:, None].expand(-1, width)
            seqs.append(owner.masked_fill(padding, -1).flatten())
            pages.append(meta.decode_pages.flatten())
            logical.append(j.expand(num_decodes, -1).flatten())
        for i, row in enumerate(meta.prefills):
            seq, end, n = num_decodes + i, row.token_start + row.num_tokens, row.kv_pages.numel()
            q_seq[row.token_start:end] = seq
            q_pos[row.token_start:end] = torch.arange(row.context_len - row.num_tokens,
                                                      row.context_len, device=device)
            if row.mask is not None:
                q_lo[row.token_start:end] = row.mask.int().argmax(-1).int()
            seqs.append(torch.full((n,), seq, device=device))
            pages.append(row.kv_pages)
            logical.append(torch.arange(n, device=device))
        while num_decodes + len(meta.prefills) > self.capacity:  # each growth compiles anew
            self.capacity *= 2
            logger.info("flex attention: per-sequence table grown to %d rows", self.capacity)
        page_seq = torch.cat(seqs)
        return FlexStep(num_tokens, q_seq, q_pos, q_lo,
                        page_seq.masked_fill(page_seq < 0, self.capacity), torch.cat(pages),
                        torch.cat(logical).int(), self.capacity)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        step: FlexStep = meta.backend_state
        if step.block_mask is None:  # the first layer knows the pool size; the rest reuse it
            step.block_mask = self._block_mask(step, k_cache.shape[0], meta.page_size)
        n, rows = step.num_tokens, step.q_seq.numel()
        # [n, H, D] -> [1, H, Q, D] with zero padding rows; the pool [S, Hkv, D] -> [1, Hkv, S, D]
        # as strided views, no copy.
        qp = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, rows - n)).permute(1, 0, 2)[None]
        k, v = k_cache.permute(1, 0, 2)[None], v_cache.permute(1, 0, 2)[None]
        out = _flex_attention(qp, k, v, block_mask=step.block_mask, scale=scale,
                              enable_gqa=True, kernel_options=self.kernel_options)
        return out[0, :, :n].transpose(0, 1)  # [n, H, D]

    def _block_mask(self, step: FlexStep, num_slots: int, g: int) -> BlockMask:
        device, kvb, cap, rows = step.q_seq.device, self.kv_block, step.capacity, step.q_seq.numel()
        num_kv_blocks = -(-num_slots // kvb)
        # [cap + 1, pages] int32: each sequence's logical page of a pool page, -1 if not its own.
        # Wide enough for the kernel's last partial KV block; row `cap` takes decode padding.
        inverse = torch.full((cap + 1, -(-num_kv_blocks * kvb // g)), -1, dtype=torch.int32,
                             device=device)
        inverse[step.page_seq, step.page_ids] = step.page_logical
        inverse = inverse[:cap]
        # [cap + 1, kv blocks]: the KV blocks holding a page of each sequence (first, last slot).
        holds = torch.zeros(cap + 1, num_kv_blocks, device=device)
        holds[step.page_seq, step.page_ids * g // kvb] = 1
        holds[step.page_seq, (step.page_ids * g + g - 1) // kvb] = 1
        # [query blocks, cap + 1]: the sequences with a real query row in each query block.
        at = torch.arange(rows, device=device)
        asks = torch.zeros(rows // QUERY_BLOCK, cap + 1, device=device)
        asks[at // QUERY_BLOCK, step.q_seq.long().masked_fill(at >= step.num_tokens, cap)] = 1
        needed = (asks[:, :cap] @ holds[:cap]) > 0  # [query blocks, kv blocks]
        kv_num_blocks = needed.sum(-1, dtype=torch.int32)
        kv_indices = needed.to(torch.int8).argsort(dim=-1, descending=True, stable=True).int()
        q_seq, q_pos, q_lo = step.q_seq, step.q_pos, step.q_lo

        def mask_mod(b, h, q_idx, kv_idx):
            # The slot's position in the query's sequence; negative, so hidden, if not its page.
            pos = inverse[q_seq[q_idx], kv_idx // g] * g + kv_idx % g
            return (pos >= q_lo[q_idx]) & (pos <= q_pos[q_idx])

        # Every listed block is partial (mask_mod applies): no "full block" fast path yet.
        return BlockMask.from_kv_blocks(kv_num_blocks[None, None], kv_indices[None, None],
                                        BLOCK_SIZE=(QUERY_BLOCK, kvb), mask_mod=mask_mod,
                                        seq_lengths=(rows, num_slots), compute_q_blocks=False)
