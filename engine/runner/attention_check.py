"""Start-up of the attention backend: checked against the reference, then warmed up.

A kernel that fails to compile or disagrees on this device would otherwise fail requests at
serving time; checked once at start-up, `auto` falls back to the reference instead. On the real
pool the check also compiles the backend's first graph before traffic arrives, and on CUDA the
warm-up compiles the other step sizes too; just before serving, refresh_warm_up compiles them
again if an import since has changed what compiled graphs guard on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, cast

import torch

from engine.attention.reference import AttentionMetadata, ReferenceAttention, reference_attention
from engine.attention.select import fallback_backend
from engine.runner.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler.base import ScheduledBatch
from engine.sequence import Sequence

if TYPE_CHECKING:
    from engine.attention.flex import FlexAttention

logger = logging.getLogger(__name__)

# Largest |fast - reference| allowed, by KV dtype: fp32 is exact up to summation order.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def check_attention_backend(runner: ModelRunner) -> float | None:
    """Max abs difference to the reference over synthetic steps (two decodes, and a chunk after
    a prefix, in reversed blocks: together when the pool has room, else one at a time); raises
    AssertionError past the tolerance. None: the pool is too small for either."""
    decode, chunk = (20, 1), (4, 5)  # (computed, scheduled) tokens of one sequence
    together = [decode, (37, 1), chunk]  # flex: three query blocks, the decodes' side by side
    cases = [together] if _fits(runner, together) else [[decode], [chunk]]
    errors = [_check(runner, case) for case in cases if _fits(runner, case)]
    backend = runner.attention
    if not (backend.reads_decode_mask or backend.reads_prefill_mask):
        # a backend that bounds rows by position reads the window itself: a windowed model's
        # layers are checked too, whatever this model's layers do
        errors += [_check(runner, case, window=3) for case in cases if _fits(runner, case)]
    return max(errors) if errors else None


def _blocks(runner: ModelRunner, case: list[tuple[int, int]]) -> list[int]:
    return [-(-(computed + n) // runner.block_size) for computed, n in case]


def _fits(runner: ModelRunner, case: list[tuple[int, int]]) -> bool:
    return sum(_blocks(runner, case)) <= runner.kv_cache.shape[2] // runner.block_size


def _check(runner: ModelRunner, case: list[tuple[int, int]], window: int | None = None
           ) -> float:
    needed = _blocks(runner, case)
    blocks = list(range(sum(needed)))[::-1]
    seqs = []
    for i, ((computed, n), count) in enumerate(zip(case, needed, strict=True)):
        seq = Sequence(i, [3 + i] * (computed + n), SamplingParams())
        seq.num_computed_tokens = computed
        # every block table alike: the check reads the first attention group only
        seq.block_tables = [blocks[:count]] * runner.layout.num_tables
        blocks = blocks[count:]
        seqs.append(seq)
    used_slots = sum(needed) * runner.block_size
    k_cache, v_cache = runner.kv_cache[0, 0], runner.kv_cache[0, 1]
    spec = runner.spec
    generator = torch.Generator(device=runner.device).manual_seed(0)
    with torch.inference_mode():
        meta = runner.attention_metadata(ScheduledBatch(tuple(seqs), tuple(n for _, n in case)))
        if window is not None:
            meta = _windowed(meta, window)
        for cache in (k_cache, v_cache):
            cache[:used_slots] = torch.randn(cache[:used_slots].shape, generator=generator,
                                             device=runner.device).to(cache.dtype)
        q = torch.randn(meta.slot_mapping.numel(), spec.num_heads, spec.head_dim,
                        generator=generator, device=runner.device).to(k_cache.dtype)
        scale = spec.head_dim ** -0.5
        try:
            got = runner.attention.forward(q, k_cache, v_cache, meta, scale).float()
            want = reference_attention(q.float(), k_cache[:used_slots].float(),
                                       v_cache[:used_slots].float(), meta, scale)
        finally:
            k_cache[:used_slots] = 0
            v_cache[:used_slots] = 0
    error = (got - want).abs().max().item()
    limit = TOLERANCE[k_cache.dtype]
    assert error <= limit, f"differs from the reference by {error:.3g} (> {limit:g})"
    return error


def _windowed(meta: AttentionMetadata, window: int) -> AttentionMetadata:
    """The first attention group's step for layers attending within `window` (masks unbuilt:
    only for backends that read none; the reference builds its own from the bounds)."""
    lo = None if meta.decode_ctx is None else (meta.decode_ctx - window).clamp(min=0)
    meta = replace(meta if meta.groups is None else meta.groups[0], window=window, decode_lo=lo,
                   decode_mask=None, groups=None, layer_groups=None)
    return replace(meta, backend_state=meta.backend.prepare(meta))


# Query-row buckets compiled at start-up; a step with more tokens compiles on first use.
WARM_UP_MAX_ROWS = 16384  # flex pads each sequence to 16-row blocks: 8,192 tokens + decodes
# Devices whose backend compiles its step sizes at start-up (on the CPU each takes seconds of
# C++ compiling: it compiles on first use there; tests warm up on the CPU too).
WARM_UP_DEVICES = ("cuda",)


def pytree_types() -> int:
    """The types torch's pytree knows. Compiled graphs guard on their number: an import that
    registers more (transformers' model outputs, on a first tokenizer load) makes every
    compiled step size recompile once, in the first step of that size after it: seen as
    0.3-0.7 s pauses of every stream on an H100 when a burst of prompts arrived."""
    return len(torch.utils._pytree.SUPPORTED_NODES)


def warm_up_buckets(max_rows: int, block_tokens: int) -> list[int]:
    """The padded query sizes (powers of two from 16) a backend compiles for, up to the
    smallest bucket holding `max_rows` tokens, WARM_UP_MAX_ROWS and what the pool holds."""
    limit = min(max_rows, WARM_UP_MAX_ROWS, block_tokens)
    buckets = [16]
    while buckets[-1] < limit:
        buckets.append(buckets[-1] * 2)
    return [b for b in buckets if b <= block_tokens]


def warm_up_attention(runner: ModelRunner, max_rows: int) -> list[int]:
    """Runs the backend once per query bucket (one prompt of that many tokens), so compiling
    happens before traffic, not as a stall of seconds in the first requests of each size.
    Returns the buckets run. Reads the pool only (zeros here), writes nothing to it."""
    pool_tokens = runner.kv_cache.shape[2]
    spec = runner.spec
    done = []
    with torch.inference_mode():
        for rows in warm_up_buckets(max_rows, pool_tokens):
            seq = Sequence(0, [3] * rows, SamplingParams())
            seq.block_tables = [list(range(-(-rows // runner.block_size)))] * \
                runner.layout.num_tables
            meta = runner.attention_metadata(ScheduledBatch((seq,), (rows,)))
            q = torch.zeros(rows, spec.num_heads, spec.head_dim, device=runner.device,
                            dtype=runner.kv_cache.dtype)
            k_cache, v_cache = runner.kv_cache[0, 0], runner.kv_cache[0, 1]
            runner.attention.forward(q, k_cache, v_cache, meta, spec.head_dim ** -0.5)
            done.append(rows)
    runner.attention.warmed_up = max_rows, pytree_types()
    return done


def refresh_warm_up(runner: ModelRunner) -> bool:
    """Just before serving: warm the backend up again if torch's pytree registry changed since
    its warm-up (an import in between), so the recompiles happen now, not in served steps.
    True when it did (logged: an import order to fix)."""
    warmed = getattr(runner.attention, "warmed_up", None)
    if warmed is None or warmed[1] == pytree_types():
        return False
    started = time.monotonic()
    warm_up_attention(runner, warmed[0])
    logger.warning("attention backend %s compiled its step sizes again in %.1f s: torch's "
                   "pytree registry went from %d to %d types after the warm-up (an import), "
                   "which would have recompiled each size in a served step",
                   runner.attention.name, time.monotonic() - started, warmed[1], pytree_types())
    return True


def prepare_attention(runner: ModelRunner, asked: str, max_num_seqs: int, max_tokens: int,
                      max_model_len: int = 0) -> None:
    """Before serving: size the backend for `max_num_seqs` sequences of up to `max_model_len`
    tokens, check it against the reference (`auto` falls back: select.fallback_backend), and
    on CUDA compile its step sizes for steps of up to `max_tokens` tokens (flex pads them to
    more rows)."""
    max_rows = _reserve(runner, max_num_seqs, max_tokens, max_model_len)
    if not check_or_fall_back(runner, asked):  # the fallback is checked in its turn
        max_rows = _reserve(runner, max_num_seqs, max_tokens, max_model_len)
        check_or_fall_back(runner, asked)
    if hasattr(runner.attention, "reserve") and runner.device.type in WARM_UP_DEVICES:
        # (flex still: not fallen back.) Each new step size would otherwise stall its requests
        # for seconds (seen on an H100).
        started = time.monotonic()
        buckets = warm_up_attention(runner, max_rows)
        logger.info("attention backend %s compiled for steps of up to %d tokens in %.1f s",
                    runner.attention.name, buckets[-1] if buckets else 0,
                    time.monotonic() - started)


def _reserve(runner: ModelRunner, max_num_seqs: int, max_tokens: int,
             max_model_len: int) -> int:
    """Size flex's tables once (never regrown); the query rows a step may take."""
    if not hasattr(runner.attention, "reserve"):
        return max_tokens
    sized = cast("FlexAttention", runner.attention)
    max_rows = sized.query_rows(max_tokens, max_num_seqs)
    warm_up_rows = warm_up_buckets(max_rows, runner.kv_cache.shape[2])[-1:]
    sized.reserve(max_num_seqs, max([max_model_len, *warm_up_rows]))
    return max_rows


def check_or_fall_back(runner: ModelRunner, asked: str) -> bool:
    """A fast backend must pass its start-up check; `auto` falls back (False: it did)."""
    if isinstance(runner.attention, ReferenceAttention):
        return True
    try:
        error = check_attention_backend(runner)
    except Exception as err:  # a kernel that cannot compile here fails the same way
        if asked != "auto":
            raise ValueError(f"invalid attention_backend={asked!r}: it failed its start-up "
                             f"check on this device: {err}") from err
        fallback = fallback_backend(runner.attention, runner.device)
        logger.warning("attention backend %s failed its start-up check (%s); using the %s "
                       "backend", runner.attention.name, err, fallback.name)
        runner.use_attention(fallback)
        return False
    logger.info("attention backend %s matches the reference (max difference %s)",
                runner.attention.name, "unchecked: pool too small" if error is None else
                f"{error:.2g}")
    return True
