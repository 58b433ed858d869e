"""The Triton paged attention backend: every step's rows, decodes and prompt chunks alike, in
one kernel launch per layer reading K and V in place (engine/attention/paged_kernel.py).

No gathered copy of the context and no boolean mask: a row's visible keys are its position,
its sequence's context and the layer's window, and the kernel walks only those pages. The same
kernel runs on CUDA (compiled) and on the CPU through Triton's interpreter (slowly: it is how
CI proves the GPU path, token for token, without a GPU). prepare() turns the step's metadata
into per-sequence tables once per step; every layer of the step shares them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import ModuleType
from typing import cast

import torch

from engine.attention.reference import AttentionBackend, AttentionMetadata
from engine.kernels.triton_setup import import_triton

logger = logging.getLogger(__name__)

MIN_DOT_ROWS = 16  # Triton's matrix product takes tiles of at least 16 rows
PROMPT_ROWS = 64  # query rows a program takes when a step holds a prompt chunk
KEY_TILE = 32  # keys a program reads per iteration (2-4 pages of 16 or 8)
SPLIT_MIN_KEYS = 1024  # a slice of fewer keys costs more to merge than it saves
MAX_SPLITS = 16


@dataclass
class PagedStep:
    """The step's sequences as the kernel reads them: decode rows first, then prompt rows."""

    pages: torch.Tensor  # [S, W] int64: each sequence's pages, in position order
    q_start: torch.Tensor  # [S] int64: its first query row
    q_len: torch.Tensor  # [S] int64: its query rows
    ctx: torch.Tensor  # [S] int64: its positions after this step (its last query's + 1)
    num_decodes: int  # sequences of one query, first in the tables
    prompt_tokens: tuple[int, ...]  # query rows of each following sequence
    split_kv: int  # key-range slices per program (flash-decoding), 1: none
    # query blocks: block_q -> (cu_blocks [S + 1] int64, their count), built by the first
    # layer (the query block depends on its heads per KV head)
    blocks: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)

    def query_blocks(self, block_q: int) -> tuple[torch.Tensor, int]:
        """cu_blocks [S + 1] for query blocks of block_q tokens, and their count."""
        if block_q not in self.blocks:
            if not self.prompt_tokens:  # one block a sequence: device ops only (graphs)
                cu = torch.arange(self.num_decodes + 1, device=self.q_len.device)  # [S + 1]
                self.blocks[block_q] = cu, self.num_decodes
            else:
                counts = [1] * self.num_decodes + [-(-n // block_q) for n in self.prompt_tokens]
                cu_host = [0]
                for count in counts:
                    cu_host.append(cu_host[-1] + count)
                self.blocks[block_q] = _upload(cu_host, self.q_len.device), cu_host[-1]
        return self.blocks[block_q]


class TritonPagedAttention(AttentionBackend):
    """Paged attention through one Triton kernel; fp32 (exact up to summation order), fp16
    and bf16; GQA, sliding windows, soft-capping, shared prefix pages."""

    name = "triton"
    reads_decode_mask = reads_prefill_mask = False  # rows are bounded by position and window
    reads_pool_in_place = True  # padded decode graphs may call it with the pool's page tables
    caps_scores = True

    def __init__(self, device: torch.device, key_tile: int = KEY_TILE,
                 split_kv: int | None = None) -> None:
        import_triton(device)  # before the kernel module's import: compiled or interpreted
        from engine.attention import paged_kernel

        self.kernel: ModuleType = paged_kernel
        self.device = device
        self.key_tile = key_tile
        self.split_kv = split_kv  # None: chosen per step (CUDA only; 1 elsewhere)
        self.processors = (torch.cuda.get_device_properties(device).multi_processor_count
                           if device.type == "cuda" else 0)

    def prepare(self, meta: AttentionMetadata) -> PagedStep:
        """Capture-safe for decode-only steps (no host tables uploaded)."""
        device = meta.slot_mapping.device
        parts: list[tuple[torch.Tensor, ...]] = []
        num_decodes, longest_ctx = 0, 0
        if meta.decode_token_idx is not None:
            # set with decode_token_idx (engine/runner/step_metadata.py)
            assert meta.decode_pages is not None and meta.decode_ctx is not None
            num_decodes = meta.decode_token_idx.numel()
            parts.append((meta.decode_pages, meta.decode_token_idx,
                          torch.ones_like(meta.decode_token_idx), meta.decode_ctx))
            longest_ctx = (max(meta.decode_context_lens) if meta.decode_context_lens
                           else meta.decode_pages.shape[1] * meta.page_size)  # a bound
        if meta.prefills:
            parts.append(_prefill_part(meta, device))
            longest_ctx = max(longest_ctx, *(row.context_len for row in meta.prefills))
        pages, q_start, q_len, ctx = _concat(parts)
        prompt_tokens = tuple(row.num_tokens for row in meta.prefills)
        splits = self._splits(num_decodes, bool(prompt_tokens), longest_ctx)
        return PagedStep(pages, q_start, q_len, ctx, num_decodes, prompt_tokens, splits)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float,
                softcap: float | None = None) -> torch.Tensor:
        if self.device.type == "cpu" and k_cache.dtype == torch.bfloat16:
            # NumPy, which the interpreter computes in, has no bfloat16
            raise ValueError("Triton's interpreter (CPU) cannot run a bfloat16 KV pool; "
                             "serve float32 or float16 on the CPU")
        step = cast(PagedStep, meta.backend_state)  # what prepare() returned
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [N, H, D]
        group = _next_power_of_2(q.shape[1] // k_cache.shape[1])  # query heads per KV head
        # rows per program: a matrix product's worth of query tokens x heads for prompt
        # chunks; for one-query sequences, the fewest rows a matrix product takes
        block_q = max(1, (PROMPT_ROWS if step.prompt_tokens else MIN_DOT_ROWS) // group)
        cu_blocks, num_blocks = step.query_blocks(block_q)
        self.kernel.paged_attention(
            q, k_cache, v_cache, out, step.pages, step.q_start, step.q_len, step.ctx,
            cu_blocks, num_blocks, meta.page_size, scale, meta.window, softcap, block_q,
            self.key_tile, step.split_kv)
        return out

    def _splits(self, num_decodes: int, prompts: bool, longest_ctx: int) -> int:
        """Slices of the key range per program: on a GPU that few programs would leave idle,
        when contexts are long enough to pay for the merge (decode-only steps)."""
        if self.split_kv is not None:
            return self.split_kv
        if self.processors == 0 or prompts or longest_ctx < 2 * SPLIT_MIN_KEYS:
            return 1
        # (the grid's KV-head axis multiplies the programs again: a bound on the idle ones)
        want = -(-2 * self.processors // max(1, num_decodes))
        return max(1, min(MAX_SPLITS, want, longest_ctx // SPLIT_MIN_KEYS))


def _prefill_part(meta: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The prompt rows' tables: pages [P, W], q_start, q_len, ctx [P]."""
    rows = meta.prefills
    width = max(row.kv_pages.numel() for row in rows)
    pages = torch.zeros(len(rows), width, dtype=torch.int64, device=device)  # [P, W]
    for i, row in enumerate(rows):
        pages[i, :row.kv_pages.numel()] = row.kv_pages
    host = [[row.token_start for row in rows], [row.num_tokens for row in rows],
            [row.context_len for row in rows]]
    q_start, q_len, ctx = _upload(host, device)  # [3, P]
    return pages, q_start, q_len, ctx


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _concat(parts: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """Sequence tables of the decode part and the prompt part, one below the other."""
    if len(parts) == 1:
        return parts[0]
    (pd, *rest_d), (pp, *rest_p) = parts
    width = max(pd.shape[1], pp.shape[1])
    pages = torch.cat([torch.nn.functional.pad(pd, (0, width - pd.shape[1])),
                       torch.nn.functional.pad(pp, (0, width - pp.shape[1]))])
    return (pages, *(torch.cat([a, b]) for a, b in zip(rest_d, rest_p, strict=True)))


def _upload(values: list, device: torch.device) -> torch.Tensor:
    """A small host table on the device without a host sync (pinned, copied asynchronously:
    torch's host allocator keeps the buffer until the copy is done)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
