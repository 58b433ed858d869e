"""Start-up of the padded decode path: on CUDA, capture its graphs and check them against the
eager step before /ping turns 200; on any failure or disagreement, log why and run eagerly."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from engine.decode_graphs import LOGIT_TOLERANCE, PaddedDecode, capture_cuda_graphs
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler.base import ScheduledBatch
from engine.sequence import Sequence

logger = logging.getLogger(__name__)


def prepare_decode_graphs(runner: ModelRunner, enforce_eager: bool, max_rows: int,
                          max_model_len: int, padded_on_cpu: bool = False,
                          prompt_rows: bool = True, max_seqs: int | None = None,
                          shrink_on_oom: bool = True, piecewise: bool = True) -> bool:
    """CUDA graphs for steps of up to `max_rows` tokens (decodes, and prompt chunks as rows
    where `prompt_rows`; logits for up to `max_seqs` of them) unless `enforce_eager`; returns
    whether they are on. Where `piecewise` and `prompt_rows`, the steps of up to as many rows
    that whole-step graphs leave out run as graphs cut at attention. With `padded_on_cpu`, a
    CPU runs the same padded buckets and pieces without graphs (CI's stand-in).
    `shrink_on_oom=False` (tensor parallelism: every rank must pad a step alike) turns graphs
    off where a smaller row cap would have been tried."""
    piecewise = piecewise and prompt_rows
    if runner.device.type != "cuda":
        if not padded_on_cpu or enforce_eager:
            return False
        padded = runner.enable_padded_decode(max_rows, max_model_len, prompt_rows, max_seqs,
                                             piecewise)
        error = check_padded_decode(runner)
        logger.info("padded decode on CPU (no graphs): batch buckets %s; max logit difference "
                    "to eager %.3g", padded.batch_buckets, error)
        if piecewise:
            runner.enable_piecewise(max_rows, max_seqs or max_rows)
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
                                             max_seqs, floor, piecewise)
    except Exception as err:  # capture unsupported here, or the graphs disagree with eager
        logger.warning("CUDA graphs are off, every step runs eagerly: %s", err)
        captured = None
    if captured is None:
        runner.padded_decode = None
        runner.kv_cache.zero_()
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
        prepare_piecewise_graphs(runner, padded.batch_buckets[-1], max_seqs or max_rows,
                                 needed)
    return True


def prepare_piecewise_graphs(runner: ModelRunner, max_rows: int, max_seqs: int,
                             buckets: list[int]) -> bool:
    """Piecewise graphs (engine/piecewise_graphs.py) of the row `buckets` whose steps may
    pass the whole-step graphs' gather bound (steps of up to `max_rows` tokens), checked
    against eager; on failure or disagreement, log why and run those steps eagerly. Returns
    whether they are on."""
    started = time.monotonic()
    piecewise = runner.enable_piecewise(max_rows, max_seqs)
    try:
        with _stream_restored():
            count = piecewise.capture(runner.spec.vocab_size, buckets)
        error = check_piecewise(runner)
        failure = None
    except Exception as err:  # capture unsupported here, or the pieces disagree with eager
        failure = str(err).splitlines()[0] if str(err) else type(err).__name__
    if failure is not None:  # past the except block: no traceback holds the graphs now
        runner.piecewise = None
        piecewise.release()
        del piecewise
        runner.kv_cache.zero_()
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
                          prompt_rows: bool, max_seqs: int | None, floor: int | None = None,
                          pieces_follow: bool = True) -> tuple[PaddedDecode, int, float]:
    """Capture and check the graphs of steps up to `max_rows` tokens; where the device runs out
    of memory, try half as many rows, down to `floor` (default: the decode batch), and say so.
    Fewer rows mean smaller gathers only while rows x max_model_len tokens of K and V stay
    under MAX_PADDED_GATHER_BYTES. → (padded, graph count, logit error)."""
    floor = floor or min(max_rows, max_seqs or max_rows)
    rows = max_rows
    while True:
        padded = runner.enable_padded_decode(rows, max_model_len, prompt_rows, max_seqs,
                                             pieces_follow)
        try:
            count = capture_cuda_graphs(padded, runner.spec.vocab_size)
            return padded, count, check_padded_decode(runner)
        except torch.OutOfMemoryError as err:
            if rows <= floor:
                runner.padded_decode = None
                raise
            reason = str(err).splitlines()[0]
        # here, past the except block, the error's frames no longer hold the graphs
        runner.padded_decode = None
        del padded
        runner.kv_cache.zero_()
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


def check_padded_decode(runner: ModelRunner) -> float:
    """Max |padded - eager| logit over a synthetic step of decode rows with different
    contexts (a bucket with padding rows; one past a sliding window where the model has one)
    and a 3-token prompt chunk, as far as the pool room, max_model_len and the buckets allow;
    raises AssertionError past the dtype's tolerance. Uses the empty pool's first blocks and
    zeroes the pool afterwards."""
    padded = runner.padded_decode
    assert padded is not None, "enable_padded_decode() first"
    batch = _synthetic_step(runner, padded.fits, padded.max_sampled, padded.prompt_rows)
    error = _against_eager(runner, batch, lambda: runner.padded_logits(
        runner.stage(batch, describe=False)[0]))
    limit = LOGIT_TOLERANCE[runner.kv_cache.dtype]
    assert error <= limit, f"padded decode differs from eager by {error:.3g} (> {limit:g})"
    return error


def check_piecewise(runner: ModelRunner) -> float:
    """check_padded_decode's synthetic step through the piecewise path (engine/
    piecewise_graphs.py) against eager: max |piecewise - eager| logit; AssertionError past
    the dtype's tolerance."""
    piecewise = runner.piecewise
    assert piecewise is not None, "enable_piecewise() first"
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
        error = max(error, _against_eager(runner, batch, lambda b=batch: runner.piecewise_logits(
            *runner.stage(b)[:2])))
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
    seqs, scheduled = [], []
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
                   other: Callable[[], torch.Tensor]) -> float:
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
            return (other() - eager).abs().max().item()
    finally:
        cache.zero_()
