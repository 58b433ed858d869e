"""ModelRunner: the only place that builds device tensors. Batch in, sampled tokens out."""

from __future__ import annotations

from dataclasses import replace

import torch

from engine.attention.reference import (
    AttentionBackend,
    AttentionMetadata,
    PrefillRow,
    ReferenceAttention,
    causal_mask,
    page_size_for,
)
from engine.models.spec import ModelSpec
from engine.outputs import SampledToken
from engine.phases import NoPhases, StepPhases
from engine.sampler import GreedyKernel, sample
from engine.scheduler.base import ScheduledBatch


class ModelRunner:
    """Owns the model and the KV pool; run() does one forward pass and samples."""

    def __init__(self, model, spec: ModelSpec, device: torch.device, dtype: torch.dtype,
                 num_blocks: int, block_size: int,
                 attention: AttentionBackend | None = None) -> None:
        self.model = model
        self.attention = attention or ReferenceAttention()
        self.spec = spec
        self.device = device
        self.block_size = block_size
        self.page_size = page_size_for(block_size)
        self.greedy: GreedyKernel | None = None  # a faster argmax + logprob (CPU kernels)
        self.phases: StepPhases | NoPhases = NoPhases()  # LLMEngine.measure_phases sets it
        # [layers, 2, num_blocks * block_size, num_kv_heads, head_dim]; zeroed so padding is finite
        self.kv_cache = torch.zeros(spec.num_layers, 2, num_blocks * block_size, spec.num_kv_heads,
                                    spec.head_dim, dtype=dtype, device=device)

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[SampledToken | None]:
        """Forward the batch's scheduled tokens; sample for sequences that caught up."""
        input_ids, positions, meta, last_rows = self._prepare(batch)
        self.phases.mark("prepare")
        hidden = self.model(input_ids, positions, meta, self.kv_cache)  # [num_tokens, hidden]
        sampled = [i for i in range(len(batch.seqs)) if batch.is_sampled(i)]
        out: list[SampledToken | None] = [None] * len(batch.seqs)
        if not sampled:
            self.phases.mark("forward")
            return out
        rows = torch.tensor([last_rows[i] for i in sampled], device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))  # [S, vocab] float32
        self.phases.mark("forward")
        for i, token in zip(sampled, sample(logits, [batch.seqs[i] for i in sampled],
                                            self.greedy), strict=True):
            out[i] = token
        self.phases.mark("sample")
        return out

    def _prepare(self, batch: ScheduledBatch):
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_rows: list[int] = []
        decode_rows: list[int] = []
        decode_seqs = []
        prefills = []
        for seq, n in zip(batch.seqs, batch.num_scheduled_tokens, strict=True):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            row = len(ids)
            ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += self._slots(seq.block_table, start, end)
            last_rows.append(row + n - 1)
            if n == 1:
                decode_rows.append(row)
                decode_seqs.append((seq.block_table, end))
            else:
                prefills.append(self._prefill_row(seq.block_table, row, n, end))
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots), page_size=self.page_size,
            decode_token_idx=self._tensor(decode_rows) if decode_rows else None,
            **self._decode_gather(decode_seqs), prefills=tuple(prefills), backend=self.attention,
            decode_context_lens=tuple(context for _, context in decode_seqs))
        meta = replace(meta, backend_state=self.attention.prepare(meta))
        return self._tensor(ids), self._tensor(positions), meta, last_rows

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def _pages(self, block_table: list[int], context: int) -> list[int]:
        """Pages holding positions 0..context-1 (a page is page_size consecutive slots)."""
        per_block = self.block_size // self.page_size
        return [block_table[j // per_block] * per_block + j % per_block
                for j in range(-(-context // self.page_size))]

    def _prefill_row(self, block_table: list[int], row: int, n: int, context: int) -> PrefillRow:
        return PrefillRow(row, n, context, self._tensor(self._pages(block_table, context)),
                          causal_mask(n, context, self.spec.sliding_window, self.device))

    def _decode_gather(self, decode_seqs: list[tuple[list[int], int]]) -> dict:
        """Padded page indices and visibility mask for the single-query rows."""
        if not decode_seqs:
            return {"decode_pages": None, "decode_mask": None}
        pages = [self._pages(table, ctx) for table, ctx in decode_seqs]
        width = max(len(p) for p in pages)
        padded = self._tensor([p + [0] * (width - len(p)) for p in pages])  # [B, max_pages]
        pos = torch.arange(width * self.page_size, device=self.device)  # [T]
        ctx = self._tensor([c for _, c in decode_seqs]).unsqueeze(1)  # [B, 1]
        visible = pos.unsqueeze(0) < ctx  # [B, T]
        if self.spec.sliding_window is not None:
            visible &= pos.unsqueeze(0) > ctx - 1 - self.spec.sliding_window
        return {"decode_pages": padded, "decode_mask": visible[:, None, None, :]}

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)
