"""Steps too wide for a whole-step graph, run as CUDA graphs cut at every attention call.

A whole-step graph (whole_step.py) gathers each token row's context for attention, so its
buckets stop at MAX_PADDED_GATHER_BYTES of rows x context: a 512-token chunk of a long
prompt ran eagerly, host-bound (~15 ms for a 1B on an H100 against ~3 ms for a graphed decode
step). Here such a step is padded to a row bucket over static inputs and runs as one graph per
stretch of work between attention calls (embedding, norms, projections, RoPE, the KV store,
MLPs, logits: everything that treats each token on its own) with attention run eagerly between
them, on the real rows, with the step's own metadata (vLLM's piecewise graphs, its default
mode's fallback). Padding rows write only the scratch slot and attend to nothing (their output
is zeros); only the sampled rows' logits are read.

The same padded pieces run eagerly on CPU, which is how CI proves them (the cut is where the
real attention runs); on CUDA they are captured after the whole-step graphs and checked against
the eager step at start-up (engine/runner/graphs/setup.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from engine.attention.reference import AttentionBackend, AttentionMetadata
from engine.kv.layout import KVLayout
from engine.runner.graphs.whole_step import batch_buckets, bucket_for

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

logger = logging.getLogger(__name__)


class _Cut(AttentionBackend):
    """What a piecewise step's layers call for attention in attention group `group`."""

    name = "piecewise-cut"
    reads_decode_mask = False

    def __init__(self, step: PiecewiseStep, group: int) -> None:
        self.step = step
        self.group = group

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float,
                softcap: float | None = None) -> torch.Tensor:
        assert softcap is None, "caps_scores is False"
        return self.step.attend(self.group, q, k_cache, v_cache, scale)


@dataclass(frozen=True)
class _Attention:
    """One attention call of a captured step: between the pieces before and after it."""

    group: int  # the attention group its layer reads (AttentionMetadata.groups)
    q: torch.Tensor  # [rows, H, D] static: the piece before copies its queries here
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    scale: float
    out: torch.Tensor  # [rows, H, D] static: the piece after reads it


@dataclass(frozen=True)
class _Pieces:
    graphs: tuple  # torch.cuda.CUDAGraph, one more than calls
    calls: tuple[_Attention, ...]
    logits: torch.Tensor  # [min(rows, max_sampled), vocab] static


class PiecewiseStep:
    """Static inputs for steps of up to max_rows token rows, and the padded forward whose
    attention calls the graphs are cut at."""

    def __init__(self, model, layer_caches: list[torch.Tensor], layout: KVLayout,
                 scratch_slot: int, page_size: int, max_rows: int, max_num_seqs: int) -> None:
        self.model = model
        self.layer_caches = layer_caches
        self.layout = layout
        self.page_size = page_size
        self.buckets = batch_buckets(max_rows)
        self.max_sampled = min(max_num_seqs, max_rows)  # rows whose logits a step computes
        device = layer_caches[0].device
        # [2 + tables, max_rows]: token id, position, the slot in each block table. Padding
        # rows: token 0 at position 0, written to the scratch slot.
        self.pad_rows = torch.tensor([[0], [0], *[[scratch_slot]] * layout.num_tables],
                                     device=device)
        self.inputs = self.pad_rows.repeat(1, max_rows)
        self.sample_index = torch.zeros(self.max_sampled, dtype=torch.long,
                                        device=device)  # [max_sampled]
        self.cuts = [_Cut(self, g) for g in range(len(layout.group_windows))]
        self.graphs: dict[int, _Pieces] = {}
        self.steps = 0  # steps run piecewise (tests check the path was taken)
        self.replayed = False  # whether the latest step replayed captured pieces
        self._live: tuple[AttentionMetadata, int] | None = None  # eager: the real step
        self._capture: _Capture | None = None
        # attention's input and output in captured steps, [max rows, H, D] each, by (H, D,
        # dtype): shared by every call (each is used between one piece and the next), so a
        # bucket's q holds no graph memory past its piece
        self._buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def fits(self, num_rows: int) -> bool:
        return bucket_for(num_rows, self.buckets) is not None

    def run(self, tokens: torch.Tensor, meta: AttentionMetadata,
            sample_rows: torch.Tensor) -> torch.Tensor:
        """tokens [2 + tables, N] as the runner uploaded them, `meta` the step's attention
        metadata, sample_rows [S] (ascending, at most one per sequence) → logits [S, vocab]."""
        num_rows = tokens.shape[1]
        bucket = bucket_for(num_rows, self.buckets)
        assert bucket is not None, "the runner checks fits() first"
        num_sampled = sample_rows.numel()
        assert num_sampled <= min(bucket, self.max_sampled), "a row sampled twice?"
        self.inputs[:, :num_rows].copy_(tokens)
        self.inputs[:, num_rows:bucket].copy_(self.pad_rows.expand(-1, bucket - num_rows))
        self.sample_index[:num_sampled].copy_(sample_rows)
        self.sample_index[num_sampled:].zero_()
        self.steps += 1
        pieces = self.graphs.get(bucket)
        self.replayed = pieces is not None
        if pieces is not None:
            return self._replay(pieces, meta, num_rows)[:num_sampled]
        self._live = (meta, num_rows)
        try:
            return self.forward(bucket)[:num_sampled]
        finally:
            self._live = None

    def forward(self, bucket: int) -> torch.Tensor:
        """The padded step over the static inputs → logits [min(bucket, max_sampled), vocab]
        of the rows in sample_index; attention goes through attend()."""
        inputs = self.inputs[:, :bucket]  # [2 + tables, bucket]
        ids, positions, slots = inputs[0], inputs[1], inputs[2:]
        groups = tuple(
            AttentionMetadata(slot_mapping=slots[table], page_size=self.page_size,
                              decode_token_idx=None, decode_pages=None, decode_mask=None,
                              prefills=(), backend=cut, window=window)
            for cut, window, table in zip(self.cuts, self.layout.group_windows,
                                          self.layout.group_tables, strict=True))
        meta = groups[0] if len(groups) == 1 else replace(
            groups[0], groups=groups, layer_groups=self.layout.layer_groups)
        hidden = self.model(ids, positions, meta, self.layer_caches)  # [bucket, hidden]
        picked = self.sample_index[:min(bucket, self.max_sampled)]  # [L]
        return self.model.compute_logits(hidden.index_select(0, picked))

    def attend(self, group: int, q: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """q [bucket, H, D] → attention out [bucket, H, D]: the real rows' now (eager), or,
        while capturing, a static buffer that the next piece reads and replay fills."""
        if self._capture is not None:
            return self._capture.cut(group, q, k_cache, v_cache, scale)
        if self._live is None:  # the warm-up before a capture: no step to attend for
            key = (*q.shape[1:], q.dtype)  # the largest bucket warms up first
            if key not in self._buffers:
                self._buffers[key] = (torch.zeros_like(q), torch.zeros_like(q))
            return torch.zeros_like(q)
        meta, num_rows = self._live
        mine = _group(meta, group)
        out = torch.zeros_like(q)  # padding rows attend to nothing
        out[:num_rows] = mine.backend.forward(q[:num_rows], k_cache, v_cache, mine, scale)
        return out

    def _replay(self, pieces: _Pieces, meta: AttentionMetadata,
                num_rows: int) -> torch.Tensor:
        for _, out in self._buffers.values():  # padding rows attend to nothing, as eagerly
            out[num_rows:].zero_()  # (what they write to the scratch slot stays finite)
        for graph, call in zip(pieces.graphs, pieces.calls, strict=False):
            graph.replay()
            mine = _group(meta, call.group)
            call.out[:num_rows] = mine.backend.forward(call.q[:num_rows], call.k_cache,
                                                       call.v_cache, mine, call.scale)
        pieces.graphs[-1].replay()
        return pieces.logits

    def capture(self, vocab_size: int, buckets: list[int] | None = None) -> int:
        """Capture the pieces of `buckets` (default: every row bucket), largest first, in one
        memory pool; returns how many graphs. Attention reads and writes two static buffers
        shared by every call (each is used between one piece and the next); a failed capture
        is ended and raises. A bucket left out runs its pieces eagerly."""
        device = self.layer_caches[0].device
        logits_out = torch.empty(self.max_sampled, vocab_size, device=device)
        self.inputs.copy_(self.pad_rows.expand_as(self.inputs))  # warm-up rows: scratch only
        capture = _Capture(self._buffers)
        main, side = torch.cuda.current_stream(), torch.cuda.Stream()
        side.wait_stream(main)
        try:
            with torch.inference_mode(), torch.cuda.stream(side):
                for bucket in sorted(self.buckets if buckets is None else buckets,
                                     reverse=True):
                    self._capture_bucket(bucket, capture, logits_out)
        except BaseException:
            capture.abort()
            self.release()
            raise
        finally:
            self._capture = None
            main.wait_stream(side)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the warm-ups' blocks, cached for the side stream
        return sum(len(pieces.graphs) for pieces in self.graphs.values())

    def _capture_bucket(self, bucket: int, capture: _Capture,
                        logits_out: torch.Tensor) -> None:
        rows = min(bucket, self.max_sampled)
        self.forward(bucket)  # warm-up: lazy initialisation off the graphs
        self._capture = capture
        capture.begin()
        logits_out[:rows].copy_(self.forward(bucket))
        graphs, calls = capture.end()
        self._capture = None
        self.graphs[bucket] = _Pieces(graphs, calls, logits_out[:rows])

    def release(self) -> None:
        """Drop the graphs and buffers (a failed start-up): the cuts refer back to this step,
        so dropping the step alone would leave them to the cycle collector."""
        self.graphs.clear()
        self._buffers.clear()
        self.cuts.clear()


def _group(meta: AttentionMetadata, group: int) -> AttentionMetadata:
    return meta if meta.groups is None else meta.groups[group]


class _Capture:
    """Ends a graph at each attention call and begins the next in the same memory pool."""

    def __init__(self, buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.pool: _POOL_HANDLE | None = None
        self.buffers = buffers  # PiecewiseStep._buffers, allocated by the warm-up
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graphs: list = []
        self._calls: list[_Attention] = []

    def begin(self) -> None:
        self._graphs, self._calls = [], []
        self._start()

    def _start(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self.pool)

    def _stop(self) -> None:
        assert self._graph is not None  # _start() began it
        self._graph.capture_end()
        self.pool = self._graph.pool()
        self._graphs.append(self._graph)
        self._graph = None

    def cut(self, group: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            scale: float) -> torch.Tensor:
        q_in, out = (buffer[:q.shape[0]] for buffer in self.buffers[(*q.shape[1:], q.dtype)])
        q_in.copy_(q)  # still in the piece before the cut
        self._stop()
        self._calls.append(_Attention(group, q_in, k_cache, v_cache, scale, out))
        self._start()
        return out

    def end(self) -> tuple[tuple, tuple[_Attention, ...]]:
        self._stop()
        return tuple(self._graphs), tuple(self._calls)

    def abort(self) -> None:
        """End a capture that failed midway (the stream must not stay in capture mode)."""
        if self._graph is not None:
            try:
                self._graph.capture_end()
            except RuntimeError as err:
                logger.debug("ending a failed piecewise capture: %s", err)
            self._graph = None
