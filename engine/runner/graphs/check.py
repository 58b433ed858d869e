"""The graph paths' start-up check: a synthetic step through the padded (or piecewise) path
and through the eager step over the same random KV; their logits must agree within the dtype's
tolerance before the runner keeps the path (engine/runner/graphs/setup.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.runner.graphs.whole_step import LOGIT_TOLERANCE
from engine.sampling_params import SamplingParams
from engine.scheduler.base import ScheduledBatch
from engine.sequence import Sequence

if TYPE_CHECKING:  # the graphs are handed to the runner; they never import it
    from engine.runner.model_runner import ModelRunner


def check_padded_decode(runner: ModelRunner) -> float:
    """Max |padded - eager| logit over a synthetic step of decode rows with different
    contexts (a bucket with padding rows; one past a sliding window where the model has one)
    and a 3-token prompt chunk, as far as the pool room, max_model_len and the buckets allow;
    raises AssertionError past the dtype's tolerance. Uses the empty pool's first blocks and
    zeroes the pool afterwards."""
    padded = runner.padded_decode
    assert padded is not None, "runner.use_padded_decode() first"
    batch = _synthetic_step(runner, padded.fits, padded.max_sampled, padded.prompt_rows)
    error = _against_eager(runner, batch, lambda: runner.padded_logits(
        runner.stage(batch, describe=False)[0]))
    limit = LOGIT_TOLERANCE[runner.kv_cache.dtype]
    assert error <= limit, f"padded decode differs from eager by {error:.3g} (> {limit:g})"
    return error


def check_piecewise(runner: ModelRunner) -> float:
    """check_padded_decode's synthetic step through the piecewise path (piecewise.py) against
    eager: max |piecewise - eager| logit; AssertionError past the dtype's tolerance."""
    piecewise = runner.piecewise
    assert piecewise is not None, "runner.use_piecewise() first"
    small = _synthetic_step(runner, lambda rows, _: piecewise.fits(rows),
                            piecewise.max_sampled, prompt_rows=True)
    # and a prompt of as many tokens as the largest (captured) bucket the pool and the
    # positions allow: the steps this path is for, replaying their graphs where captured
    room = min(runner.spec.max_position_embeddings,
               runner.scratch_slot // runner.block_size // runner.layout.num_tables
               * runner.block_size)
    fitting = [b for b in (sorted(piecewise.graphs) or piecewise.buckets) if b <= room]
    assert fitting, f"no piecewise bucket fits the start-up check's {room} tokens of room"
    error = 0.0
    for batch in (small, _prompt_step(runner, fitting[-1])):
        def piecewise_step(b: ScheduledBatch = batch) -> torch.Tensor | None:
            return runner.piecewise_logits(*runner.stage(b)[:2])

        error = max(error, _against_eager(runner, batch, piecewise_step))
    assert piecewise.replayed or not piecewise.graphs, "the check replayed no captured piece"
    limit = LOGIT_TOLERANCE[runner.kv_cache.dtype]
    assert error <= limit, f"piecewise steps differ from eager by {error:.3g} (> {limit:g})"
    return error


def _synthetic_step(runner: ModelRunner, fits: Callable[[int, int], bool], max_sampled: int,
                    prompt_rows: bool) -> ScheduledBatch:
    """Decode rows of different contexts and (`prompt_rows`) a 3-token chunk, in the empty
    pool's first blocks, as far as the pool, max_model_len and `fits(rows, pages)` allow."""
    bs, page = runner.block_size, runner.page_size
    free = list(range(runner.scratch_slot // bs))[::-1]  # every block but the scratch one
    generator = torch.Generator().manual_seed(0)
    seqs: list[Sequence] = []
    scheduled: list[int] = []
    tables = runner.layout.num_tables
    rows = [(5, 1)]  # (context, tokens this step); the chunk early, so that few sequences do
    if prompt_rows:
        rows.append((page + 7, 3))
    rows += [(bs + 3, 1), (3 * bs + 1, 1)]
    windows = [w for w in runner.layout.group_windows if w is not None]
    if windows:  # a row past the narrowest window: its layers read only the window's pages
        rows.append((min(windows) + page + 1, 1))
    widest = 0
    for ctx, n in rows:
        need, pages = -(-ctx // bs), max(widest, -(-ctx // page))
        if (need * tables > len(free) or not fits(sum(scheduled) + n, pages)
                or len(seqs) == max_sampled):
            continue
        widest = pages
        ids = torch.randint(0, runner.spec.vocab_size, (ctx,), generator=generator).tolist()
        seq = Sequence(len(seqs), ids, SamplingParams())
        seq.num_computed_tokens = ctx - n
        seq.block_tables = [free[k * need:(k + 1) * need] for k in range(tables)]
        free = free[need * tables:]
        seqs.append(seq)
        scheduled.append(n)
    assert seqs, "the pool or max_model_len is too small for one decode row"
    return ScheduledBatch(tuple(seqs), tuple(scheduled))


def _prompt_step(runner: ModelRunner, tokens: int) -> ScheduledBatch:
    """One fresh prompt of `tokens` random tokens in the empty pool's first blocks."""
    need = -(-tokens // runner.block_size)
    ids = torch.randint(0, runner.spec.vocab_size, (tokens,),
                        generator=torch.Generator().manual_seed(1)).tolist()
    seq = Sequence(0, ids, SamplingParams())
    seq.block_tables = [list(range(k * need, (k + 1) * need))
                        for k in range(runner.layout.num_tables)]
    return ScheduledBatch((seq,), (tokens,))


def _against_eager(runner: ModelRunner, batch: ScheduledBatch,
                   other: Callable[[], torch.Tensor | None]) -> float:
    """Max |other() - eager| logit of `batch`'s sequences, each run over the same random KV
    (refilled before `other`, so that a chunk's last row must read what that pass itself wrote
    for the chunk's other tokens); zeroes the pool afterwards."""
    cache = runner.kv_cache

    def fill() -> None:
        cache.normal_(generator=torch.Generator(cache.device).manual_seed(0))

    try:
        with torch.inference_mode():
            fill()
            views, meta, _ = runner.stage(batch)
            eager = runner.eager_logits(views, meta, list(range(len(batch.seqs))))
            fill()
            logits = other()
            assert logits is not None and eager is not None  # every row of `batch` samples
            return (logits - eager).abs().max().item()
    finally:
        cache.zero_()
