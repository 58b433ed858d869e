"""ModelRunner: the only place that builds device tensors. Batch in, sampled tokens out.

A step crosses between host and device twice: one upload of everything the host decided
(step_buffer.py) and one download of the sampled tokens (sampler.py). Masks and aranges are
derived on the device from the uploaded integers.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol, cast

import torch

from engine.attention.reference import (
    AttentionBackend,
    AttentionMetadata,
    LayerExchange,
    ReferenceAttention,
    page_size_for,
)
from engine.kv.layout import KVLayout, shared_layout
from engine.lora.manager import AdapterRegistry
from engine.lora.runtime import LoraRuntime
from engine.models.spec import ModelSpec
from engine.observe.phases import NoPhases, PhaseClock
from engine.outputs import SampledToken
from engine.runner import kv_transfer
from engine.runner.graphs.piecewise import PiecewiseStep
from engine.runner.graphs.whole_step import PaddedDecode
from engine.runner.sampler import GreedyKernel, SampledRows, Sampler
from engine.runner.step_buffer import StepBuffer
from engine.runner.step_metadata import StepViews, describe_step
from engine.runner.step_pages import stage_decodes, stage_prefill_pages
from engine.runner.step_plan import StepPlan, pack_step, token_rows
from engine.runner.tp_workers import WorkerLost
from engine.scheduler.base import ScheduledBatch
from engine.sequence import Sequence


class PlanSender(Protocol):
    """Hands each step's plan to the other tensor-parallel ranks (engine/runner/tp_workers.py)."""

    size: int  # ranks, this one included

    def send(self, plan: StepPlan) -> None: ...
    def kill(self) -> None: ...
    def check(self) -> None: ...
    def stop(self, timeout: float = ...) -> None: ...


class StepResult:
    """A launched step: one SampledToken (or None) per batch sequence, once the device is done."""

    def __init__(self, num_seqs: int, sampled: list[int], rows: SampledRows | None) -> None:
        self.num_seqs = num_seqs
        self.sampled = sampled
        self.rows = rows

    def tokens(self) -> list[SampledToken | None]:
        """Each sequence's sample (its last row's, where it verified proposals)."""
        out: list[SampledToken | None] = [None] * self.num_seqs
        if self.rows is not None:
            for i, token in zip(self.sampled, self.rows.tokens(), strict=True):
                out[i] = token
        return out

    def rows_by_seq(self) -> list[list[SampledToken]]:
        """Each sequence's samples in order: one, or one per proposal plus one."""
        out: list[list[SampledToken]] = [[] for _ in range(self.num_seqs)]
        if self.rows is not None:
            for i, token in zip(self.sampled, self.rows.tokens(), strict=True):
                out[i].append(token)
        return out


class ModelRunner:
    """Owns the model and the KV pool; run() does one forward pass and samples."""

    def __init__(self, model, spec: ModelSpec, device: torch.device, dtype: torch.dtype,
                 num_blocks: int, block_size: int,
                 attention: AttentionBackend | None = None,
                 layout: KVLayout | None = None) -> None:
        self.model = model
        self.layout = layout or shared_layout(spec.windows)
        self.attention = attention or ReferenceAttention()
        self.spec = spec
        self.device = device
        self.block_size = block_size
        self.page_size = page_size_for(block_size)
        self.sampler = Sampler()  # LLMEngine gives it the CPU greedy kernel where it fits
        self.buffer = StepBuffer(device)
        self.phases: PhaseClock = NoPhases()  # measure() replaces it
        # [tensors, 2, (num_blocks + 1) * block_size, num_kv_heads, head_dim]: a tensor per
        # layer, or per layer of a KV group (engine/kv/layout.py); zeroed so padding is finite.
        # The last block is scratch: no sequence owns it; padding rows write there.
        self.kv_cache = torch.zeros(self.layout.num_tensors, 2, (num_blocks + 1) * block_size,
                                    spec.num_kv_heads, spec.head_dim, dtype=dtype, device=device)
        # what the model reads: each layer's [2, slots, Hkv, D]
        self.layer_caches = tuple(self.kv_cache[t] for t in self.layout.layer_tensors)
        self.scratch_slot = num_blocks * block_size
        # the graph paths, handed over by engine/runner/graphs/setup.py (use_graphs)
        self.padded_decode: PaddedDecode | None = None
        self.piecewise: PiecewiseStep | None = None
        self.last_step_graph = False  # whether the latest step replayed a CUDA graph
        self.peers: PlanSender | None = None  # the worker ranks, when tensor parallel
        # The latest step's samples and whose they are (seq id -> row): a later step whose
        # input is still pending reads it from there, on the device.
        self._carry: tuple[SampledRows, dict[int, int]] | None = None
        # LoRA: the wrapped layers' slots, and (rank 0) the registry naming the adapters
        self.lora: LoraRuntime | None = None
        self.adapters: AdapterRegistry | None = None
        self.exchange: LayerExchange | None = None  # the next step's (use_exchange)

    def use_padded_decode(self, padded: PaddedDecode | None) -> None:
        """Run the steps that fit `padded`'s buckets through it (whole-step CUDA graphs where
        captured; engine/runner/graphs/setup.py builds and checks it); None: eagerly."""
        self.padded_decode = padded

    def use_piecewise(self, piecewise: PiecewiseStep | None) -> None:
        """Run the steps that the padded path leaves out and `piecewise` fits through it
        (graphs cut at attention, where captured); None: eagerly."""
        self.piecewise = piecewise

    def use_attention(self, backend: AttentionBackend) -> None:
        """Attend through `backend` from the next step on (a start-up check's fallback)."""
        self.attention = backend

    def use_greedy_kernel(self, greedy: GreedyKernel | None) -> None:
        """Greedy rows sample through this CPU kernel (engine/models/cpu_fused.py); None: torch."""
        self.sampler.greedy = greedy

    def use_lora(self, lora: LoraRuntime, adapters: AdapterRegistry | None) -> None:
        """Rows of sequences with a LoRA adapter add its update (engine/lora/); `adapters`:
        rank 0's registry (worker ranks read what the plan loads from its folder)."""
        self.lora, self.adapters = lora, adapters

    def use_exchange(self, exchange: LayerExchange | None) -> None:
        """The next step trades K/V with another worker between its layers (cooperative
        prefill, engine/disagg/runahead.py): it runs eagerly, and `exchange` ends with it."""
        self.exchange = exchange

    def use_peers(self, peers: PlanSender | None) -> None:
        """Send each step's plan to these tensor-parallel ranks first; None: this rank alone."""
        self.peers = peers

    def measure(self, phases: PhaseClock) -> None:
        """Mark each step's host phases on `phases` (LLMEngine.measure_phases)."""
        self.phases = phases

    def clear_kv(self) -> None:
        """Zero the whole pool: what a start-up check or an abandoned capture wrote there."""
        self.kv_cache.zero_()

    def export_kv(self, seq: Sequence, end: int, start: int = 0) -> torch.Tensor:
        """[layers, 2, end - start, Hkv, D]: the K/V of positions start..end-1 of `seq`."""
        return kv_transfer.export_kv(self.kv_cache, self.layout, seq, self.block_size, end,
                                     start)

    def import_kv(self, seq: Sequence, start: int, kv: torch.Tensor, kv_start: int = 0) -> None:
        """Write another pool's K/V of `seq` (export_kv's, from position kv_start) into its
        blocks from position `start` on."""
        kv_transfer.import_kv(self.kv_cache, self.layout, seq, self.block_size, start, kv,
                              kv_start)

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    def run(self, batch: ScheduledBatch) -> list[SampledToken | None]:
        """Forward the batch's scheduled tokens; sample for sequences that caught up."""
        return self.launch(batch).tokens()

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> StepResult:
        """Queue the batch's forward and sampling on the device; the host may plan the next step
        while it runs. An input still pending is read from the previous launch's samples."""
        plan = self.pack(batch)
        sampling = sampled_rows(batch, plan.sampled)
        if self.peers is None:
            rows = self.execute(plan, sampling)
        else:
            assert not plan.carried, "worker ranks cannot read rank 0's samples"
            self.peers.send(plan)  # tensor parallel: the other ranks run the same plan
            try:
                rows = self.execute(plan, sampling)
            except Exception as err:
                self.peers.kill()  # mid-step: their collectives would wait for ours
                raise WorkerLost(f"tensor-parallel step failed on rank 0: {err}") from err
        owners = {batch.seqs[i].seq_id: k for k, i in enumerate(plan.sampled)}
        self._carry = (rows, owners) if rows is not None else None
        return StepResult(plan.num_seqs, plan.sampled, rows)

    @torch.inference_mode()
    def execute(self, plan: StepPlan, sampling: list[Sequence] | None) -> SampledRows | None:
        """Run a packed step; `sampling` holds the sequences of plan.sampled (None on a
        tensor-parallel worker rank, which computes its share and samples nothing)."""
        exchange, self.exchange = self.exchange, None
        padded = exchange is None and self._padded(plan)
        piecewise = (not padded and exchange is None and self.piecewise is not None
                     and self.piecewise.fits(len(plan.ids))
                     and len(plan.sample_rows) <= self.piecewise.max_sampled)
        views, meta, sampler_plan = self._stage(plan, sampling, describe=not padded)
        if self.lora is not None:  # fixed shapes on the graph paths: rows masked by slot
            self.lora.stage(list(plan.lora_rows), plan.lora_loads,
                            self.adapters.get if self.adapters is not None else None,
                            padded or piecewise, views.get("lora_rows"))
        self.phases.mark("prepare")
        if padded:
            assert self.padded_decode is not None  # _padded() is False without it
            logits = self.padded_logits(views)
            self.last_step_graph = self.padded_decode.replayed
        elif piecewise:
            assert self.piecewise is not None
            logits = self.piecewise_logits(views, meta)
            self.last_step_graph = self.piecewise.replayed
        else:
            if exchange is not None:
                meta = replace(meta, kv_exchange=exchange)
            logits = self.eager_logits(views, meta, plan.sampled)
            self.last_step_graph = False
        self.phases.mark("forward")  # [S, vocab] float32, or None: the step only wrote KV
        if logits is None or sampling is None:
            return None
        rows = self.sampler.launch(logits, sampler_plan, views)
        self.phases.mark("sample")
        return rows

    def eager_logits(self, views: dict[str, torch.Tensor], meta: AttentionMetadata,
                     sampled: list[int]) -> torch.Tensor | None:
        """The model over every packed token → logits [S, vocab] float32 of the sampled rows
        (None when no row samples)."""
        input_ids, positions = views["tokens"][:2]  # [N] each
        hidden = self.model(input_ids, positions, meta, self.layer_caches)  # [N, hidden]
        if not sampled:
            return None
        return self.model.compute_logits(hidden.index_select(0, views["sample_rows"]))

    def padded_logits(self, views: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """A step staged as token rows through its bucket (a CUDA graph where captured) →
        logits [S, vocab] float32 of the sampled rows (None when no row samples)."""
        rows = views["sample_rows"]  # [S] ascending packed rows
        assert self.padded_decode is not None  # called when _padded() chose this path
        logits = self.padded_decode.run(views["tokens"], views["decode"], views["decode_pages"],
                                        rows)  # [S, vocab]
        return logits if rows.numel() else None

    def piecewise_logits(self, views: dict[str, torch.Tensor],
                         meta: AttentionMetadata) -> torch.Tensor | None:
        """A step run padded, cut at attention (piecewise graphs where captured) → logits
        [S, vocab] float32 of the sampled rows (None when no row samples)."""
        rows = views["sample_rows"]  # [S] ascending packed rows
        assert self.piecewise is not None  # called when execute() found it fits
        logits = self.piecewise.run(views["tokens"], meta, rows)  # [S, vocab]
        return logits if rows.numel() else None

    def attention_metadata(self, batch: ScheduledBatch) -> AttentionMetadata:
        """What attention sees for `batch` (start-up checks and tests drive backends with it)."""
        return self.stage(batch)[1]

    def stage(self, batch: ScheduledBatch, describe: bool = True):
        """(device views, attention metadata, sampler plan) of `batch`, uploaded: what run()
        computes from (start-up checks and tests call it)."""
        plan = self.pack(batch)
        return self._stage(plan, sampled_rows(batch, plan.sampled), describe)

    def _padded(self, plan: StepPlan) -> bool:
        """A step whose tokens, as rows (engine/runner/graphs/whole_step.py), fit a bucket."""
        if self.padded_decode is None or (plan.prefills and not self.padded_decode.prompt_rows):
            return False
        if len(plan.sample_rows) > self.padded_decode.max_sampled:  # many proposals verified
            return False
        widest = max(max(d[2] for d in plan.decodes) if plan.decodes else 0,  # contexts
                     max(p[3] for p in plan.prefills) if plan.prefills else 0)
        return self.padded_decode.fits(len(plan.ids), -(-widest // self.page_size))

    def pack(self, batch: ScheduledBatch) -> StepPlan:
        """The step's integers, decided on the host (engine/runner/step_plan.py)."""
        owners = self._carry[1] if self._carry is not None else {}
        long_rope_rows = (0 if self.spec.rope_long_after is None
                          else self.spec.max_position_embeddings)
        plan = pack_step(batch, self.block_size, owners, long_rope_rows,
                         self.layout.num_tables)
        if self.lora is None or self.adapters is None:
            return plan
        rows, loads = self.lora.plan_rows([seq.lora_key for seq in batch.seqs],
                                          batch.num_scheduled_tokens, self.adapters.path_of)
        return replace(plan, lora_rows=tuple(rows), lora_loads=tuple(loads))

    def _stage(self, plan: StepPlan, sampling: list[Sequence] | None, describe: bool = True):
        """Write the plan (and the sampling parameters) into the step buffer, upload it once,
        and describe it for attention (unless the padded path, which describes itself, runs
        it: then every token is staged as a decode row)."""
        buffer = self.buffer
        buffer.reset()
        # [2 + tables, N]: token ids, positions, then the slots of each block table
        buffer.put("tokens", [plan.ids, plan.positions, *plan.slots],
                   shape=(2 + len(plan.slots), len(plan.ids)))
        buffer.put("sample_rows", plan.sample_rows)
        page_spans: list[tuple[int, int]] = []
        paging = self.page_size, self.block_size, self.layout.num_tables
        window = self.spec.sliding_window
        if describe:
            stage_decodes(buffer, plan.decodes, *paging, window)
            page_spans = stage_prefill_pages(buffer, plan.prefills, *paging)
        else:  # the padded path: every token a row, a prompt chunk's as its own decode rows
            stage_decodes(buffer, token_rows(plan), *paging, window)
        if plan.lora_rows:  # each row's adapter slot, with the step's one upload
            buffer.put("lora_rows", plan.lora_rows)
        sampler_plan = self.sampler.stage(sampling, buffer) if sampling else None
        if plan.carried:
            buffer.put("carried", [[dst for dst, _ in plan.carried],
                                   [src for _, src in plan.carried]], shape=(2, len(plan.carried)))
        views = buffer.upload()
        if plan.carried:  # the pending inputs, from the previous step's samples on the device
            assert self._carry is not None  # pack() carries only from a previous step's rows
            dst, src = views["carried"]
            views["tokens"][0].index_copy_(0, dst, self._carry[0].ids().index_select(0, src))
        meta = self._metadata(views, plan.decodes, plan.prefills, page_spans) if describe \
            else None
        return views, meta, sampler_plan

    def _metadata(self, views: dict[str, torch.Tensor], decodes: list, prefills: list,
                  page_spans: list[tuple[int, int]]) -> AttentionMetadata:
        """The step as attention sees it, per attention group (engine/runner/step_metadata.py)."""
        return describe_step(StepViews(views, decodes, prefills, page_spans), self.layout,
                             self.attention, self.page_size, self.spec.sliding_window)


class ProposalRow:
    """A sequence as the sampler sees it at one of its proposals: its first `cut` tokens (the
    output position, hence the seed's draw, the EOS mask and the penalties, of that row)."""

    def __init__(self, seq: Sequence, cut: int) -> None:
        self.params, self.constraint = seq.params, seq.constraint
        self.eos_token_ids, self.sampling_seed = seq.eos_token_ids, seq.sampling_seed
        self.num_prompt_tokens = seq.num_prompt_tokens
        self.token_ids = seq.token_ids[:cut]

    # Sequence's own, over these fields
    num_output_tokens = Sequence.num_output_tokens
    output_token_ids = Sequence.output_token_ids


def sampled_rows(batch: ScheduledBatch, sampled: list[int]) -> list[Sequence]:
    """The sampler's view of each sampled row: the sequence itself, or, for a sequence verifying
    k proposals, the sequence before its last k, k - 1, ..., 0 of them."""
    rows: list[Sequence] = []
    later = 0  # rows of the same sequence after this one
    for at in range(len(sampled) - 1, -1, -1):
        seq = batch.seqs[sampled[at]]
        later = later + 1 if at + 1 < len(sampled) and sampled[at + 1] == sampled[at] else 0
        rows.append(seq if not seq.num_drafts
                    else cast(Sequence, ProposalRow(seq, seq.num_tokens - later)))
    rows.reverse()
    return rows
