"""Start-up check: a fast attention backend must match the reference on the real pool.

A kernel that fails to compile or disagrees on this device would otherwise fail requests at
serving time; checked once at start-up, `auto` falls back to the reference instead. On the real
pool the check also compiles the backend's first graph before traffic arrives.
"""

from __future__ import annotations

import torch

from engine.attention import reference_attention
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler.base import ScheduledBatch
from engine.sequence import Sequence

# Largest |fast - reference| allowed, by KV dtype: fp32 is exact up to summation order.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def check_attention_backend(runner: ModelRunner) -> float | None:
    """Max abs difference to the reference on one synthetic step (a decode and a chunk after a
    prefix, in reversed blocks); raises AssertionError past the tolerance. None: pool too small."""
    bs, num_blocks = runner.block_size, runner.kv_cache.shape[2] // runner.block_size
    lengths = [(20, 1), (4, 5)]  # (computed, scheduled) per sequence
    needed = [-(-(c + n) // bs) for c, n in lengths]
    if sum(needed) > num_blocks or max(c + n for c, n in lengths) > bs * num_blocks:
        return None
    blocks = list(range(sum(needed)))[::-1]
    seqs = []
    for i, ((computed, n), count) in enumerate(zip(lengths, needed, strict=True)):
        seq = Sequence(i, [3 + i] * (computed + n), SamplingParams())
        seq.num_computed_tokens = computed
        seq.block_table, blocks = blocks[:count], blocks[count:]
        seqs.append(seq)
    used_slots = sum(needed) * bs
    k_cache, v_cache = runner.kv_cache[0, 0], runner.kv_cache[0, 1]
    spec = runner.spec
    generator = torch.Generator(device=runner.device).manual_seed(0)
    with torch.inference_mode():
        meta = runner._prepare(ScheduledBatch(tuple(seqs), tuple(n for _, n in lengths)))[2]
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
