"""Start-up of the padded decode path: build its step objects, capture their graphs on CUDA,
hand them to the runner and check them against the eager step before /ping turns 200; on any
failure or disagreement, take them back, log why and run eagerly."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from engine.runner.graphs.check import check_padded_decode, check_piecewise
from engine.runner.graphs.piecewise import PiecewiseStep
from engine.runner.graphs.whole_step import PaddedDecode, capture_cuda_graphs

if TYPE_CHECKING:  # the graphs are handed to the runner; they never import it
    from engine.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def build_padded_decode(runner: ModelRunner, max_rows: int, max_model_len: int,
                        prompt_rows: bool = True, max_num_seqs: int | None = None,
                        pieces_follow: bool = True) -> PaddedDecode:
    """Steps of up to `max_rows` tokens padded to row and width buckets over static buffers
    (what whole-step CUDA graphs replay) over `runner`'s model and pool: pure decode steps, and
    steps with prompt tokens too where `prompt_rows`; logits for up to `max_num_seqs` rows;
    `pieces_follow`: piecewise graphs take the steps past the gather bound. Not yet in use:
    runner.use_padded_decode hands it over."""
    max_pages = -(-max_model_len // runner.page_size)
    return PaddedDecode(runner.model, runner.layer_caches, runner.layout, runner.scratch_slot,
                        runner.page_size, max_rows, max_pages, prompt_rows, max_num_seqs,
                        pieces_follow, runner.attention)


def build_piecewise(runner: ModelRunner, max_rows: int, max_num_seqs: int) -> PiecewiseStep:
    """The steps of up to `max_rows` tokens that the padded path leaves out, padded to a row
    bucket and cut at attention (what piecewise CUDA graphs replay); logits for up to
    `max_num_seqs` rows. Not yet in use: runner.use_piecewise hands it over."""
    return PiecewiseStep(runner.model, list(runner.layer_caches), runner.layout,
                         runner.scratch_slot, runner.page_size, max_rows, max_num_seqs)


def prepare_decode_graphs(runner: ModelRunner, enforce_eager: bool, max_rows: int,
                          max_model_len: int, padded_on_cpu: bool = False,
                          prompt_rows: bool = True, max_num_seqs: int | None = None,
                          shrink_on_oom: bool = True, piecewise: bool = True) -> bool:
    """CUDA graphs for steps of up to `max_rows` tokens (decodes, and prompt chunks as rows
    where `prompt_rows`; logits for up to `max_num_seqs` of them) unless `enforce_eager`; returns
    whether they are on. Where `piecewise` and `prompt_rows`, the steps of up to as many rows
    that whole-step graphs leave out run as graphs cut at attention. With `padded_on_cpu`, a
    CPU runs the same padded buckets and pieces without graphs (CI's stand-in).
    `shrink_on_oom=False` (tensor parallelism: every rank must pad a step alike) turns graphs
    off where a smaller row cap would have been tried."""
    piecewise = piecewise and prompt_rows
    if runner.device.type != "cuda":
        if not padded_on_cpu or enforce_eager:
            return False
        padded = build_padded_decode(runner, max_rows, max_model_len, prompt_rows, max_num_seqs,
                                     piecewise)
        runner.use_padded_decode(padded)
        error = check_padded_decode(runner)
        logger.info("padded decode on CPU (no graphs): batch buckets %s; max logit difference "
                    "to eager %.3g", padded.batch_buckets, error)
        if piecewise:
            runner.use_piecewise(build_piecewise(runner, max_rows, max_num_seqs or max_rows))
            check_piecewise(runner)
        return True
    if enforce_eager:
        logger.info("CUDA graphs off (option.enforce_eager=true or option.cudagraph_mode=none): "
                    "every step runs eagerly")
        return False
    started = time.monotonic()
    floor = None if shrink_on_oom else max_rows
    try:
        with _stream_restored():
            captured = capture_within_memory(runner, max_rows, max_model_len, prompt_rows,
                                             max_num_seqs, floor, piecewise)
    except Exception as err:  # capture unsupported here, or the graphs disagree with eager
        logger.warning("CUDA graphs are off, every step runs eagerly: %s", err)
        captured = None
    if captured is None:
        runner.use_padded_decode(None)
        runner.clear_kv()
        torch.cuda.empty_cache()  # the failed graphs' pool, now that no traceback holds it
        return False
    padded, count, error = captured
    logger.info("CUDA graphs: %d step graphs (token-row buckets %s, up to %d pages of %d "
                "tokens) captured and checked in %.1f s; max logit difference to eager %.3g", count,
                padded.batch_buckets, padded.width_buckets[-1], padded.page_size,
                time.monotonic() - started, error)
    # Row buckets some of whose steps pass the gather bound: a smaller one's steps all fit
    widest = padded.width_buckets[-1]
    needed = [b for b in padded.batch_buckets if padded.bucket(b, widest) is None]
    if piecewise and needed:
        prepare_piecewise_graphs(runner, padded.batch_buckets[-1], max_num_seqs or max_rows,
                                 needed)
    return True


def prepare_piecewise_graphs(runner: ModelRunner, max_rows: int, max_num_seqs: int,
                             buckets: list[int]) -> bool:
    """Piecewise graphs (engine/runner/graphs/piecewise.py) of the row `buckets` whose steps may
    pass the whole-step graphs' gather bound (steps of up to `max_rows` tokens), checked
    against eager; on failure or disagreement, log why and run those steps eagerly. Returns
    whether they are on."""
    started = time.monotonic()
    piecewise = build_piecewise(runner, max_rows, max_num_seqs)
    try:
        with _stream_restored():
            count = piecewise.capture(runner.spec.vocab_size, buckets)
        runner.use_piecewise(piecewise)
        error = check_piecewise(runner)
        failure = None
    except Exception as err:  # capture unsupported here, or the pieces disagree with eager
        failure = str(err).splitlines()[0] if str(err) else type(err).__name__
    if failure is not None:  # past the except block: no traceback holds the graphs now
        runner.use_piecewise(None)
        piecewise.release()
        del piecewise
        runner.clear_kv()
        torch.cuda.empty_cache()
        logger.warning("piecewise CUDA graphs are off: steps that whole-step graphs do not "
                       "cover run eagerly (%s)", failure)
        return False
    logger.info("piecewise CUDA graphs: %d pieces for the steps whole-step graphs do not cover "
                "(cut at each attention call; token-row buckets %s), captured and checked in "
                "%.1f s; max logit difference to eager %.3g", count, buckets,
                time.monotonic() - started, error)
    return True


def capture_within_memory(runner: ModelRunner, max_rows: int, max_model_len: int,
                          prompt_rows: bool, max_num_seqs: int | None, floor: int | None = None,
                          pieces_follow: bool = True) -> tuple[PaddedDecode, int, float]:
    """Capture and check the graphs of steps up to `max_rows` tokens; where the device runs out
    of memory, try half as many rows, down to `floor` (default: the decode batch), and say so.
    Fewer rows mean smaller gathers only while rows x max_model_len tokens of K and V stay
    under MAX_PADDED_GATHER_BYTES. → (padded, graph count, logit error)."""
    floor = floor or min(max_rows, max_num_seqs or max_rows)
    rows = max_rows
    while True:
        padded = build_padded_decode(runner, rows, max_model_len, prompt_rows, max_num_seqs,
                                     pieces_follow)
        try:
            count = capture_cuda_graphs(padded, runner.spec.vocab_size)
            runner.use_padded_decode(padded)
            return padded, count, check_padded_decode(runner)
        except torch.OutOfMemoryError as err:
            if rows <= floor:
                runner.use_padded_decode(None)
                raise
            reason = str(err).splitlines()[0]
        # here, past the except block, the error's frames no longer hold the graphs
        runner.use_padded_decode(None)
        del padded
        runner.clear_kv()
        torch.cuda.empty_cache()  # the abandoned graphs' pool (a no-op where CUDA is unused)
        fewer = max(floor, rows // 2)
        logger.warning("CUDA graphs of steps up to %d tokens ran out of GPU memory (%s); trying "
                       "%d: longer steps will run eagerly (a lower option.gpu_memory_utilization "
                       "keeps them)", rows, reason, fewer)
        rows = fewer


@contextmanager
def _stream_restored() -> Iterator[None]:
    """torch.cuda.graph's exit leaves its capture stream current where ending the capture
    fails: the steps after a failed capture must run on the stream they ran on before."""
    stream = torch.cuda.current_stream() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        if stream is not None:
            torch.cuda.set_stream(stream)
