"""FlexAttention over the KV pool: K/V are read in place, without the reference's gather copy.

The whole pool is one key sequence of num_slots and the step's tokens one query sequence, in
which each sequence's rows start a block of 16 query rows of their own (a decode row: one real
row and 15 padding rows). mask_mod keeps (query, slot) when the slot holds a visible position of
the query's own sequence, looked up in an inverse page table (pool page -> logical page, per
sequence); pages shared by several sequences (prefix cache) are fine. The BlockMask built once
per step lists, per query block, the KV blocks of its one sequence's pages, in logical order,
from the first its rows see to its last row's, so the kernel skips the rest of the pool. One
sequence per block matters on a GPU: the kernel walks a query block's KV blocks in one program
(~0.65 µs each on an H200), and when decode rows of 16 sequences shared a block, that program
walked all their pages: 10 of a 1B decode step's 13 ms on the device at 32 sequences of 1,000
tokens. On CUDA FlexAttention compiles to Triton kernels; on CPU to C++ (slow to compile; used
to test this logic).

Recompilation: graphs are compiled per shape (dynamic=False). Query rows are padded to a power
of two, and the per-sequence tables to capacities that only grow (the engine reserves
max_num_seqs and max_model_len up front); the pool size is fixed. So steady decoding reuses one
graph, and a server compiles about log2(max rows per step) graphs: on CUDA those of up to
16,384 rows at start-up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, FlexKernelOptions, flex_attention

from engine.attention.reference import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)

_flex_attention = torch.compile(flex_attention, dynamic=False, fullgraph=True)
_RECOMPILE_LIMIT = 64  # query buckets x table capacities; dynamo's default is 8
QUERY_BLOCK = 16  # the BlockMask's query block, also the smallest query bucket


@dataclass
class FlexStep:
    """One step's facts shared by every layer; the first layer adds the BlockMask."""

    token_rows: torch.Tensor  # [num_tokens] int64: each packed token's query row
    q_seq: torch.Tensor  # [Q] int32: the step sequence of each (padded) query row
    q_pos: torch.Tensor  # [Q] int32: its position; -1 on padding rows, which then see nothing
    q_lo: torch.Tensor  # [Q] int32: lowest visible position (> 0 under a sliding window)
    block_seq: torch.Tensor  # [Q / 16] int64: each query block's sequence; capacity + 1: none
    page_seq: torch.Tensor  # [N] int64: sequence of each (sequence, page) pair; capacity: none
    page_ids: torch.Tensor  # [N] int64: the page in the pool
    page_logical: torch.Tensor  # [N] int64: its index in the sequence's page list
    capacity: int  # rows of the per-sequence tables (>= number of sequences), a power of two
    max_pages: int  # their width in pages (>= any sequence's), a power of two
    block_mask: BlockMask | None = None


class FlexAttention(AttentionBackend):
    """torch FlexAttention reading the pool in place. Any block size; fp32, fp16 or bf16."""

    name = "flex"
    # decode rows are bounded by decode_ctx and decode_lo, prompt rows by position and window
    reads_decode_mask = reads_prefill_mask = False

    def __init__(self, device: torch.device, kv_block: int = 16) -> None:
        self.kv_block = kv_block
        self.capacity = 16
        self.max_pages = 16
        self.reserved_tokens = 0  # a sequence's most tokens, as reserved (pages follow from it)
        # (max_rows, pytree types) of the latest warm-up (engine/runner/attention_check.py);
        # None: none
        self.warmed_up: tuple[int, int] | None = None
        # Triton tiles equal to the BlockMask's blocks, as in vLLM's flex backend: a query
        # block holds one sequence's rows (one, for a decode), so larger tiles would mostly
        # compute padding. The main kernel, as vLLM forces too: flex_decoding (auto below 128
        # query rows) is untried with this mask.
        self.kernel_options: FlexKernelOptions | None = (
            {"BLOCK_M": QUERY_BLOCK, "BLOCK_N": kv_block, "BACKEND": "TRITON"}
            if device.type == "cuda" else None)
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, _RECOMPILE_LIMIT)
        # Past the limit dynamo would run flex_attention eagerly, which materialises scores over
        # the whole pool (out of memory on a large GPU pool): fail the step loudly instead.
        torch._dynamo.config.fail_on_recompile_limit_hit = True

    def reserve(self, num_seqs: int, max_tokens: int = 0) -> None:
        """Size the per-sequence tables for `num_seqs` sequences of up to `max_tokens` up front:
        they then never grow, and the graphs compiled at start-up serve every step."""
        while self.capacity < num_seqs:
            self.capacity *= 2
        self.reserved_tokens = max(self.reserved_tokens, max_tokens)

    @staticmethod
    def query_rows(num_tokens: int, num_seqs: int) -> int:
        """The most query rows a step of `num_tokens` tokens over `num_seqs` sequences pads to
        (each sequence's rows start a block of 16)."""
        return num_tokens + (QUERY_BLOCK - 1) * num_seqs

    def prepare(self, meta: AttentionMetadata) -> FlexStep:
        device, g = meta.slot_mapping.device, meta.page_size
        num_decodes = 0 if meta.decode_token_idx is None else meta.decode_token_idx.numel()
        spans = [-(-row.num_tokens // QUERY_BLOCK) for row in meta.prefills]  # query blocks
        num_blocks = num_decodes + sum(spans)
        rows = max(QUERY_BLOCK, 1 << (num_blocks * QUERY_BLOCK - 1).bit_length())
        self._grow(num_decodes + len(meta.prefills), max(
            [row.kv_pages.numel() for row in meta.prefills]
            + [meta.decode_pages.shape[1] if num_decodes and meta.decode_pages is not None
               else 0]), g)
        token_rows = torch.empty(meta.slot_mapping.numel(), dtype=torch.int64, device=device)
        q_seq = torch.zeros(rows, dtype=torch.int32, device=device)  # [Q]
        q_pos = torch.full((rows,), -1, dtype=torch.int32, device=device)  # [Q]
        q_lo = torch.zeros(rows, dtype=torch.int32, device=device)  # [Q]
        block_seq = torch.full((rows // QUERY_BLOCK,), self.capacity + 1, dtype=torch.int64,
                               device=device)  # [Q / 16]
        seqs, pages, logical = [], [], []
        if num_decodes:
            # set with decode_token_idx (engine/runner/step_metadata.py)
            assert meta.decode_pages is not None and meta.decode_ctx is not None
            assert meta.decode_lo is not None
            decodes = torch.arange(num_decodes, device=device)  # [B]
            first_rows = decodes * QUERY_BLOCK  # [B]: each decode row starts its own block
            token_rows[meta.decode_token_idx] = first_rows
            q_seq[first_rows] = decodes.int()
            q_pos[first_rows] = (meta.decode_ctx - 1).int()
            q_lo[first_rows] = meta.decode_lo.int()
            block_seq[:num_decodes] = decodes
            width = meta.decode_pages.shape[1]
            j = torch.arange(width, device=device)  # [P]
            padding = j >= (meta.decode_ctx[:, None] + g - 1) // g  # [B, P]: past its pages
            seqs.append(decodes[:, None].expand(-1, width).masked_fill(padding, -1).flatten())
            pages.append(meta.decode_pages.flatten())
            logical.append(j.expand(num_decodes, -1).flatten())
        block = num_decodes
        for i, (row, span) in enumerate(zip(meta.prefills, spans, strict=True)):
            seq, n, first = num_decodes + i, row.num_tokens, block * QUERY_BLOCK
            at = slice(first, first + n)
            token_rows[row.token_start:row.token_start + n] = torch.arange(first, first + n,
                                                                           device=device)
            q_seq[at] = seq
            q_pos[at] = torch.arange(row.context_len - n, row.context_len, device=device)
            if meta.window is not None:  # the first position each row sees
                q_lo[at] = (q_pos[at] - (meta.window - 1)).clamp(min=0)
            block_seq[block:block + span] = seq
            block += span
            seqs.append(torch.full((row.kv_pages.numel(),), seq, device=device))
            pages.append(row.kv_pages)
            logical.append(torch.arange(row.kv_pages.numel(), device=device))
        page_seq = torch.cat(seqs)
        return FlexStep(token_rows, q_seq, q_pos, q_lo, block_seq,
                        page_seq.masked_fill(page_seq < 0, self.capacity), torch.cat(pages),
                        torch.cat(logical), self.capacity, self.max_pages)

    def _grow(self, num_seqs: int, max_pages: int, g: int) -> None:
        """Widen the per-sequence tables to what was reserved, and for this step (each growth
        past the reservation compiles anew)."""
        while num_seqs > self.capacity:
            self.capacity *= 2
            logger.info("flex attention: per-sequence table grown to %d rows", self.capacity)
        while -(-self.reserved_tokens // g) > self.max_pages:
            self.max_pages *= 2
        if max_pages > self.max_pages:
            while max_pages > self.max_pages:
                self.max_pages *= 2
            logger.info("flex attention: per-sequence table grown to %d pages", self.max_pages)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float,
                softcap: float | None = None) -> torch.Tensor:
        assert softcap is None, "caps_scores is False"
        step = cast(FlexStep, meta.backend_state)  # what prepare() returned
        if step.block_mask is None:  # the first layer knows the pool size; the rest reuse it
            step.block_mask = self._block_mask(step, k_cache.shape[0], meta.page_size)
        rows = step.q_seq.numel()
        # [n, H, D] -> [1, H, Q, D] with each token at its row, zeros between; the pool
        # [S, Hkv, D] -> [1, Hkv, S, D] as strided views, no copy.
        qp = q.new_zeros(rows, *q.shape[1:]).index_copy_(0, step.token_rows, q)
        k, v = k_cache.permute(1, 0, 2)[None], v_cache.permute(1, 0, 2)[None]
        out = _flex_attention(qp.permute(1, 0, 2)[None], k, v, block_mask=step.block_mask,
                              scale=scale, enable_gqa=True, kernel_options=self.kernel_options)
        return out[0].transpose(0, 1).index_select(0, step.token_rows)  # [n, H, D]

    def _block_mask(self, step: FlexStep, num_slots: int, g: int) -> BlockMask:
        device, kvb, cap, rows = step.q_seq.device, self.kv_block, step.capacity, step.q_seq.numel()
        num_kv_blocks = -(-num_slots // kvb)
        # [cap + 1, pages] int32: each sequence's logical page of a pool page, -1 if not its own.
        # Wide enough for the kernel's last partial KV block; row `cap` takes decode padding.
        inverse = torch.full((cap + 1, -(-num_kv_blocks * kvb // g)), -1, dtype=torch.int32,
                             device=device)
        inverse[step.page_seq, step.page_ids] = step.page_logical.int()
        inverse = inverse[:cap]
        kv_num_blocks, kv_indices = self._kv_blocks(step, num_kv_blocks, g)
        if device.type == "cpu":  # its C++ lowering wants a column per KV block of the pool
            kv_indices = F.pad(kv_indices, (0, max(0, num_kv_blocks - kv_indices.shape[1])))
        q_seq, q_pos, q_lo = step.q_seq, step.q_pos, step.q_lo

        def mask_mod(b, h, q_idx, kv_idx):
            # The slot's position in the query's sequence; negative, so hidden, if not its page.
            pos = inverse[q_seq[q_idx], kv_idx // g] * g + kv_idx % g
            return (pos >= q_lo[q_idx]) & (pos <= q_pos[q_idx])

        # Every listed block is partial (mask_mod applies): no "full block" fast path yet.
        return BlockMask.from_kv_blocks(kv_num_blocks[None, None], kv_indices[None, None],
                                        BLOCK_SIZE=(QUERY_BLOCK, kvb), mask_mod=mask_mod,
                                        seq_lengths=(rows, num_slots), compute_q_blocks=False)

    def _kv_blocks(self, step: FlexStep, num_kv_blocks: int, g: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per query block: how many KV blocks it reads [Q / 16] int32, and which ones
        [Q / 16, width] int32 (the first so many of each row), those of its sequence's pages."""
        kvb, cap, device = self.kv_block, step.capacity, step.q_seq.device
        if g == kvb:  # a page is a KV block: the sequence's pages in logical order, from the
            # first its rows see to the last (slid past a window, a table's entries all name
            # one scratch block, which the kernel must not walk over and over: it stops after
            # as many blocks as the pool has)
            table = torch.zeros(cap + 2, step.max_pages, dtype=torch.int32, device=device)
            table[step.page_seq, step.page_logical] = step.page_ids.int()
            pos, lo = step.q_pos.view(-1, QUERY_BLOCK), step.q_lo.view(-1, QUERY_BLOCK)
            last = pos.amax(-1)  # [Q / 16]; -1: a padding block
            first = torch.where(pos >= 0, lo, last[:, None].clamp(min=0)).amin(-1) // g
            columns = (first[:, None] + torch.arange(step.max_pages, device=device)).clamp(
                max=step.max_pages - 1)  # [Q / 16, width]
            return ((last // g + 1 - first).clamp(min=0).int(),
                    table[step.block_seq].gather(1, columns))
        # Smaller pages share a KV block, pages of 12 straddle two: each sequence's distinct
        # KV blocks (a page's first and last slot's), sorted, then the pool's count past them.
        table = torch.full((cap + 2, 2 * step.max_pages), num_kv_blocks, dtype=torch.int64,
                           device=device)
        table[step.page_seq, 2 * step.page_logical] = step.page_ids * g // kvb
        table[step.page_seq, 2 * step.page_logical + 1] = (step.page_ids * g + g - 1) // kvb
        table = table.sort(-1).values
        repeat = torch.zeros_like(table, dtype=torch.bool)
        repeat[:, 1:] = table[:, 1:] == table[:, :-1]
        table = table.masked_fill(repeat, num_kv_blocks).sort(-1).values
        counts = (table < num_kv_blocks).sum(-1, dtype=torch.int32)  # [cap + 2]
        table = table.masked_fill(table == num_kv_blocks, 0).int()
        return counts[step.block_seq], table[step.block_seq]
