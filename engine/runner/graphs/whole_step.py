"""Steps padded to fixed shapes over static buffers: what a CUDA graph replays.

A step of B token rows whose contexts span W pages runs as the bucket (Bp, Wp): the smallest
batch bucket >= B and power-of-two page width >= W. A decode is one row; a prompt chunk of n
tokens is n rows, each seeing its sequence's positions up to its own (every row's K/V is written
before any row reads, so a chunk's tokens see each other). Inputs live in static tensors
(fixed addresses, as graph replay needs); the B real rows are copied in and the padding rows
point at the scratch block, the one block of the KV pool no sequence ever owns, so they write
and read only there. Decode attention is the reference's gather + SDPA over one group, whose
shapes depend on (Bp, Wp) alone. Layers with a sliding window read only the pages their window
can span from each row's first visible one.

On CUDA each bucket is captured as a CUDA graph after a start-up check against the eager path
(see check_padded_decode); elsewhere the same padded computation runs eagerly, which is how CI
proves that padding never changes a token.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from engine.attention.reference import (
    AttentionBackend,
    AttentionMetadata,
    DecodeGroup,
    ReferenceAttention,
    visible_positions,
)
from engine.kv.layout import KVLayout
from engine.runner.step_metadata import first_visible

logger = logging.getLogger(__name__)

# Most bytes of K and V one padded step gathers for a layer (rows x width x page tokens): a
# bigger bucket runs piecewise (engine/runner/graphs/piecewise.py), so that the largest whole-step
# graph's gather, which its memory pool holds, stays small beside the activation reserve.
# 256 MiB is 2^17 tokens of a grouped-query 1B (8 KV heads of 64 in bf16: 2 KiB a token), the
# bound measured on an H100 (graphs beat eager steps up to it); a 7B without grouped-query
# attention (32 of 128: 16 KiB) gets 2^14 tokens, where 2^17 would take 2 GiB of a 24 GB GPU.
MAX_PADDED_GATHER_BYTES = 256 << 20
# Where no piecewise graphs take the steps past it (tensor parallelism, expert models), a
# bucket may still gather this many tokens, the bound before it was counted in bytes: such a
# step would otherwise run eagerly, host-bound.
MAX_PADDED_TOKENS_ALONE = 2**17


# Most token rows a padded step covers (vLLM's largest capture size). Every step the token
# budget allows is graphed up to it: with requests waiting, streams that finish in the same step
# are replaced in the next one, so a full batch's steps carry 3 or more 24-token prompts beside
# it; with a 96-row cap 6-7 % of the steps ran eagerly at 11-20 ms instead of a ~3 ms graph,
# and served req/s at 40 clients fell to 0.83-0.87x offline (1B, H100, 2026-11-27).
MAX_GRAPH_ROWS = 512


def graph_rows(max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The largest padded step, in token rows: every decode batch, and every step of prompt
    tokens the budget allows, up to MAX_GRAPH_ROWS; steps with more tokens run eagerly. Graph
    count and capture time grow with it (batch_buckets thins out past 128 rows)."""
    return max(max_num_seqs, min(max_num_batched_tokens, MAX_GRAPH_ROWS))


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, then every 16 rows to 128, every 32 to 256 and every 64 beyond, up
    to max_batch (which is always the last bucket): past 128 rows a bucket pads a step by at
    most a quarter."""
    sizes = [b for b in (1, 2, 4, 8, 16, 32) if b < max_batch]
    for start, stop, stride in ((48, 128, 16), (160, 256, 32), (320, max_batch, 64)):
        sizes += [b for b in range(start, stop + 1, stride) if b < max_batch]
    return [*sizes, max_batch]


def width_buckets(max_pages: int) -> list[int]:
    """Powers of two up to max_pages (always the last bucket)."""
    sizes, w = [], 1
    while w < max_pages:
        sizes.append(w)
        w *= 2
    return [*sizes, max_pages]


def bucket_for(n: int, buckets: list[int]) -> int | None:
    return next((b for b in buckets if b >= n), None)


class PaddedDecode:
    """Static inputs for every bucket, and the padded forward that a graph captures."""

    def __init__(self, model, layer_caches: Sequence[torch.Tensor], layout: KVLayout,
                 scratch_slot: int, page_size: int, max_batch: int, max_pages: int,
                 prompt_rows: bool = True, max_num_seqs: int | None = None,
                 pieces_follow: bool = True, attention: AttentionBackend | None = None) -> None:
        self.model = model
        self.prompt_rows = prompt_rows  # whether steps with prompt tokens run padded too
        # rows whose logits a step computes: one per sequence at most (max_num_seqs), however
        # many prompt rows the step has; padded with row 0
        self.max_sampled = max_num_seqs or max_batch
        self.layer_caches = layer_caches  # each layer's [2, slots, Hkv, D]
        cache = layer_caches[0]
        self.token_bytes = cache[:, 0].numel() * cache.element_size()  # a token's K and V
        # the most K and V bytes a bucket gathers per layer; `pieces_follow`: piecewise graphs
        # take the steps past it
        self.gather_limit = MAX_PADDED_GATHER_BYTES if pieces_follow else max(
            MAX_PADDED_GATHER_BYTES, MAX_PADDED_TOKENS_ALONE * self.token_bytes)
        self.layout = layout
        self.page_size = page_size
        self.batch_buckets = batch_buckets(max_batch)
        self.width_buckets = width_buckets(max_pages)
        self.scratch_page = scratch_slot // page_size
        device = layer_caches[0].device
        tables = layout.num_tables
        # [4 + tables, max_batch]: token id, position, the slot in each block table, context
        # length, first visible position. Padding rows: token 0 at position 0, written to the
        # scratch slot, seeing only it.
        self.pad_rows = torch.tensor([[0], [0], *[[scratch_slot]] * tables, [1], [0]],
                                     device=device)
        self.inputs = self.pad_rows.repeat(1, max_batch)
        # [tables, max_batch, max_pages]: each row's pages, padded with the scratch page
        self.pages = torch.full((tables, max_batch, max_pages), self.scratch_page, device=device)
        self.rows = torch.arange(max_batch, device=device)  # [max_batch]
        self.sample_index = torch.zeros(self.max_sampled, dtype=torch.long,
                                        device=device)  # [max_sampled]
        self.positions = torch.arange(max_pages * page_size, device=device)  # [T]
        self.page_steps = torch.arange(max_pages, device=device)  # [max_pages]
        self.in_page = torch.arange(page_size, device=device)  # [page_size]
        # a backend reading the pool in place through the page tables (triton), else the
        # reference's gather + SDPA, whose shapes depend on the bucket alone
        self.attention: AttentionBackend = (
            attention if attention is not None and attention.reads_pool_in_place
            else ReferenceAttention())
        self.steps = 0  # steps run padded (tests check the path was taken)
        self.replayed = False  # whether the latest step replayed a captured graph
        self.graphs: dict[tuple[int, int], Callable[[], torch.Tensor]] = {}

    def bucket(self, batch_size: int, width: int) -> tuple[int, int] | None:
        b, w = bucket_for(batch_size, self.batch_buckets), bucket_for(width, self.width_buckets)
        if b is None or w is None or b * w * self.page_size * self.token_bytes > (
                self.gather_limit):
            return None
        return b, w

    def all_buckets(self) -> list[tuple[int, int]]:
        """Every bucket a step may run as, largest first."""
        return [(b, w) for b in reversed(self.batch_buckets)
                for w in reversed(self.width_buckets) if self.bucket(b, w) == (b, w)]

    def run(self, tokens: torch.Tensor, decode: torch.Tensor, pages: torch.Tensor,
            sample_rows: torch.Tensor) -> torch.Tensor:
        """tokens [2 + tables, B], decode [4, B] and pages [tables, B, W] as the runner uploaded
        them, sample_rows [S] (ascending rows, at most one per sequence) → logits [S, vocab]."""
        batch_size, width = pages.shape[1:]
        bucket = self.bucket(batch_size, width)
        assert bucket is not None, "the runner checks fits() first"
        num_sampled = sample_rows.numel()
        assert num_sampled <= min(bucket[0], self.max_sampled), "a row sampled twice?"
        self.stage(tokens, decode, pages, bucket)
        self.sample_index[:num_sampled].copy_(sample_rows)
        self.sample_index[num_sampled:].zero_()
        self.steps += 1
        forward = self.graphs.get(bucket)
        self.replayed = forward is not None
        logits = forward() if forward is not None else self.forward(*bucket)
        return logits[:num_sampled]

    def fits(self, batch_size: int, width: int) -> bool:
        return self.bucket(batch_size, width) is not None

    def stage(self, tokens: torch.Tensor, decode: torch.Tensor, pages: torch.Tensor,
              bucket: tuple[int, int]) -> None:
        """Copy the real rows into the static inputs; the rest of the bucket is padding."""
        (batch_size, width), (padded, padded_width) = pages.shape[1:], bucket
        known = len(tokens)  # token id, position, slots
        self.inputs[:known, :batch_size].copy_(tokens)
        self.inputs[known:, :batch_size].copy_(decode[1:3])  # context length, first visible
        self.inputs[:, batch_size:padded].copy_(self.pad_rows.expand(-1, padded - batch_size))
        self.pages[:, :batch_size, :width].copy_(pages)
        self.pages[:, :batch_size, width:padded_width].fill_(self.scratch_page)
        self.pages[:, batch_size:padded, :padded_width].fill_(self.scratch_page)

    def forward(self, padded: int, padded_width: int) -> torch.Tensor:
        """The padded step from the static inputs → logits [min(padded, max_sampled), vocab]
        of the rows in sample_index; no host sync."""
        inputs = self.inputs[:, :padded]  # [4 + tables, padded]
        ids, positions, slots, (ctx, lo) = inputs[0], inputs[1], inputs[2:-2], inputs[-2:]
        pages = self.pages[:, :padded, :padded_width]  # [tables, padded, padded_width]
        rows = self.rows[:padded]
        layout, staged = self.layout, self.model.spec.sliding_window
        firsts = {window: first_visible(ctx, lo, window, staged)
                  for window in layout.group_windows}
        seen = {window: self._window_pages(ctx, first, window, padded_width)
                for window, first in firsts.items()}
        groups = tuple(self._describe(slots[table], pages[table], rows, *seen[window], window,
                                      ctx, firsts[window])
                       for window, table in zip(layout.group_windows, layout.group_tables,
                                                strict=True))
        meta = groups[0] if len(groups) == 1 else replace(
            groups[0], groups=groups, layer_groups=layout.layer_groups)
        hidden = self.model(ids, positions, meta, self.layer_caches)  # [padded, hidden]
        picked = self.sample_index[:min(padded, self.max_sampled)]  # [L]
        return self.model.compute_logits(hidden.index_select(0, picked))

    def _window_pages(self, ctx: torch.Tensor, first: torch.Tensor, window: int | None,
                      padded_width: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Which of a row's pages layers attending within `window` read, and what of them is
        visible: (page indices [Bp, S] or None for all, visible [Bp, 1, 1, S * page_size]).
        A windowed layer reads only the S pages its window can span from the row's first
        visible one (a fixed count: graph shapes stay static), not the whole context."""
        page = self.page_size
        span = padded_width if window is None else min(padded_width, (window - 1) // page + 2)
        if span == padded_width or self.attention.reads_pool_in_place:  # (it skips the rest)
            pos = self.positions[:padded_width * page]  # [T]
            return None, visible_positions(pos, ctx, first)
        index = (first // page)[:, None] + self.page_steps[:span]  # [Bp, S]
        pos = (index[:, :, None] * page + self.in_page).flatten(1)  # [Bp, S * page]
        # pages past the row's last are masked; clamped only so that the gather stays in range
        return index.clamp(max=padded_width - 1), visible_positions(pos, ctx, first)

    def _describe(self, slots: torch.Tensor, pages: torch.Tensor, rows: torch.Tensor,
                  index: torch.Tensor | None, visible: torch.Tensor, window: int | None,
                  ctx: torch.Tensor, first: torch.Tensor) -> AttentionMetadata:
        """slots [Bp], pages [Bp, Wp] (the block table's), index [Bp, S] (those read) or None
        (all), visible [Bp, 1, 1, S * page_size]; ctx, first [Bp]: each row's visible
        positions, for a backend reading the pool in place."""
        if self.attention.reads_pool_in_place:
            meta = AttentionMetadata(
                slot_mapping=slots, page_size=self.page_size, decode_token_idx=rows,
                decode_pages=pages, decode_mask=None, prefills=(), backend=self.attention,
                decode_ctx=ctx, decode_lo=first, window=window)
            return replace(meta, backend_state=self.attention.prepare(meta))
        if index is not None:
            pages = pages.gather(1, index)  # [Bp, S]
        return AttentionMetadata(
            slot_mapping=slots, page_size=self.page_size, decode_token_idx=rows,
            decode_pages=pages, decode_mask=visible, prefills=(), backend=self.attention,
            backend_state=(DecodeGroup(rows, pages, visible),), window=window)


# Largest |padded - eager| logit difference allowed, by dtype: padding changes no value, but
# a graph or a different batch shape may sum in another order.
LOGIT_TOLERANCE = {torch.float32: 1e-3, torch.float16: 0.25, torch.bfloat16: 0.5}


def capture_cuda_graphs(padded: PaddedDecode, vocab_size: int) -> int:
    """Capture one CUDA graph per (batch, width) bucket, largest first, sharing one memory
    pool; returns how many. Logits land in one static [max_sampled, vocab] buffer."""
    logits_out = torch.empty(padded.max_sampled, vocab_size,
                             device=padded.layer_caches[0].device)
    side, pool = torch.cuda.Stream(), None
    with torch.inference_mode():
        for batch, width in padded.all_buckets():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: lazy initialisation off the graph
                padded.forward(batch, width)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            rows = min(batch, padded.max_sampled)
            with torch.cuda.graph(graph, pool=pool):
                logits_out[:rows].copy_(padded.forward(batch, width))
            pool = graph.pool()
            padded.graphs[(batch, width)] = _replayer(graph, logits_out[:rows])
    torch.cuda.synchronize()
    return len(padded.graphs)


def _replayer(graph, logits: torch.Tensor) -> Callable[[], torch.Tensor]:
    def replay() -> torch.Tensor:
        graph.replay()
        return logits
    return replay
