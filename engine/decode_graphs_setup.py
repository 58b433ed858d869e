"""Start-up of the padded decode path: on CUDA, capture its graphs and check them against the
eager step before /ping turns 200; on any failure or disagreement, log why and run eagerly."""

from __future__ import annotations

import logging
import time

import torch

from engine.decode_graphs import LOGIT_TOLERANCE, capture_cuda_graphs
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler.base import ScheduledBatch
from engine.sequence import Sequence

logger = logging.getLogger(__name__)


def prepare_decode_graphs(runner: ModelRunner, enforce_eager: bool, max_num_seqs: int,
                          max_model_len: int, padded_on_cpu: bool = False) -> bool:
    """CUDA graphs for pure decode steps unless `enforce_eager`; returns whether they are on.
    With `padded_on_cpu`, a CPU runs the same padded buckets without graphs (CI's stand-in)."""
    if runner.device.type != "cuda":
        if not padded_on_cpu or enforce_eager:
            return False
        padded = runner.enable_padded_decode(max_num_seqs, max_model_len)
        error = check_padded_decode(runner)
        logger.info("padded decode on CPU (no graphs): batch buckets %s; max logit difference "
                    "to eager %.3g", padded.batch_buckets, error)
        return True
    if enforce_eager:
        logger.info("CUDA graphs off (option.enforce_eager=true): every step runs eagerly")
        return False
    padded = runner.enable_padded_decode(max_num_seqs, max_model_len)
    started = time.monotonic()
    try:
        count = capture_cuda_graphs(padded, runner.spec.vocab_size)
        error = check_padded_decode(runner)
    except Exception as err:  # capture unsupported here, or the graphs disagree with eager
        logger.warning("CUDA graphs for decode are off, decode steps run eagerly: %s", err)
        runner.padded_decode = None
        runner.kv_cache.zero_()
        return False
    logger.info("CUDA graphs: %d decode graphs (batch buckets %s, up to %d pages of %d tokens) "
                "captured and checked in %.1f s; max logit difference to eager %.3g", count,
                padded.batch_buckets, padded.width_buckets[-1], padded.page_size,
                time.monotonic() - started, error)
    return True


def check_padded_decode(runner: ModelRunner) -> float:
    """Max |padded - eager| logit over a synthetic decode step of rows with different
    contexts (a bucket with padding rows; one past a sliding window where the model has one,
    the pool room and max_model_len allow); raises AssertionError past the dtype's tolerance.
    Uses the empty pool's first blocks and zeroes the pool afterwards."""
    padded = runner.padded_decode
    assert padded is not None, "enable_padded_decode() first"
    bs, page = runner.block_size, runner.page_size
    free = list(range(runner.scratch_slot // bs))[::-1]  # every block but the scratch one
    generator = torch.Generator().manual_seed(0)
    seqs = []
    tables = runner.layout.num_tables
    contexts = [5, bs + 3, 3 * bs + 1]
    windows = [w for w in runner.layout.group_windows if w is not None]
    if windows:  # a row past the narrowest window: its layers read only the window's pages
        contexts.append(min(windows) + page + 1)
    for ctx in contexts[:padded.batch_buckets[-1]]:
        need = -(-ctx // bs)
        if need * tables > len(free) or not padded.fits(len(seqs) + 1, -(-ctx // page)):
            break
        ids = torch.randint(0, runner.spec.vocab_size, (ctx,), generator=generator).tolist()
        seq = Sequence(len(seqs), ids, SamplingParams())
        seq.num_computed_tokens = ctx - 1
        seq.block_tables = [free[k * need:(k + 1) * need] for k in range(tables)]
        free = free[need * tables:]
        seqs.append(seq)
    assert seqs, "the pool or max_model_len is too small for one decode row"
    batch = ScheduledBatch(tuple(seqs), (1,) * len(seqs))
    cache = runner.kv_cache
    cache.normal_(generator=torch.Generator(cache.device).manual_seed(0))  # stands for context
    try:
        with torch.inference_mode():
            views, meta, _ = runner.stage(batch)
            eager = runner.eager_logits(views, meta, list(range(len(seqs))))
            graphed = runner.padded_logits(runner.stage(batch, describe=False)[0])
            error = (graphed - eager).abs().max().item()
    finally:
        cache.zero_()
    limit = LOGIT_TOLERANCE[cache.dtype]
    assert error <= limit, f"padded decode differs from eager by {error:.3g} (> {limit:g})"
    return error
