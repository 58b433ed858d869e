"""The CPU decode kernel (engine/kernels/paged_decode.c) against the reference: random pools and
block tables (windows, shared prefix blocks, pages that straddle blocks), a pool it does not read
(bfloat16), its selection, and what happens when it cannot be built."""

from __future__ import annotations

import pytest
import torch

import engine.attention.select as backends
import engine.kernels as kernels
from engine.attention.cpu import CpuPagedAttention, DecodeRows
from engine.attention.reference import (
    ReferenceAttention,
    decode_visible,
    reference_attention,
)
from engine.runner.attention_check import check_or_fall_back
from tests.engine_harness import make_engine
from tests.models_fixtures import build_tiny_model
from tests.test_attention_backends import CASES, HEAD_DIM, HEADS, prepare, random_pool

CPU = torch.device("cpu")
needs_compiler = pytest.mark.skipif(kernels.compiler() is None, reason="needs a C compiler")


@needs_compiler
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"bs{c[0]}-w{c[1]}-shared{c[3]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_paged_matches_reference(case, dtype) -> None:
    block_size, window, shapes, shared = case
    backend = CpuPagedAttention()
    torch.manual_seed(3)
    k, v = random_pool(CPU, dtype)
    with torch.inference_mode():
        meta = prepare(block_size, window, shapes, shared, backend, CPU, seed=3)
        q = torch.randn(meta.slot_mapping.numel(), HEADS, HEAD_DIM).to(dtype)
        want = reference_attention(q, k, v, meta, HEAD_DIM ** -0.5)
        got = backend.forward(q, k, v, meta, HEAD_DIM ** -0.5)
    if dtype == torch.float32:  # the kernel: same result up to summation order
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    else:  # not float32: the reference path itself
        assert torch.equal(got, want)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"bs{c[0]}-w{c[1]}-shared{c[3]}")
def test_the_kernel_needs_no_decode_mask_and_the_fallback_rebuilds_it(case) -> None:
    """The runner skips the decode mask for the kernel (it reads ctx and lo); the reference
    path under it (a bfloat16 pool) rebuilds the very mask the runner builds for others."""
    block_size, window, shapes, shared = case
    with torch.inference_mode():
        masked = prepare(block_size, window, shapes, shared, ReferenceAttention(), CPU, seed=3)
        bare = prepare(block_size, window, shapes, shared, CpuPagedAttention(), CPU, seed=3)
    assert bare.decode_mask is None
    if masked.decode_token_idx is not None:
        assert torch.equal(decode_visible(bare), masked.decode_mask)


@needs_compiler
def test_decode_only_step_reads_the_pool_in_place() -> None:
    """A step of decodes only (the common case) skips the row gather: same result."""
    backend = CpuPagedAttention()
    k, v = random_pool(CPU, torch.float32)
    with torch.inference_mode():
        meta = prepare(16, None, [(40, 1), (3, 1), (17, 1)], 0, backend, CPU, seed=1)
        assert meta.backend_state.token_idx is None
        q = torch.randn(3, HEADS, HEAD_DIM)
        torch.testing.assert_close(backend.forward(q, k, v, meta, 0.25),
                                   reference_attention(q, k, v, meta, 0.25), atol=1e-5, rtol=0)


def test_selection(monkeypatch) -> None:
    cpu_auto = backends.select_attention_backend("auto", CPU)
    assert type(cpu_auto) is (CpuPagedAttention if kernels.compiler() else
                              ReferenceAttention)
    monkeypatch.setattr(backends, "compiler", lambda: None)
    assert type(backends.select_attention_backend("auto", CPU)) is ReferenceAttention
    with pytest.raises(ValueError, match="attention_backend='cpu_paged'"):
        backends.select_attention_backend("cpu_paged", torch.device("cuda"))


def test_a_kernel_that_cannot_build_falls_back_at_start_up(tmp_path, monkeypatch) -> None:
    """No working compiler: `auto` serves with the reference, `cpu_paged` stops start-up."""
    engine = make_engine(build_tiny_model(tmp_path), "paged", block_size=4,
                         attention_backend="reference")
    runner = engine.runner
    monkeypatch.setattr(kernels, "compiler", lambda: "/bin/false")
    kernels.load_kernels.cache_clear()
    try:
        runner.attention = CpuPagedAttention()
        with pytest.raises(ValueError, match="failed its start-up check.*CPU kernels"):
            check_or_fall_back(runner, "cpu_paged")
        check_or_fall_back(runner, "auto")
        assert type(runner.attention) is ReferenceAttention
    finally:
        kernels.load_kernels.cache_clear()


@needs_compiler
def test_engine_on_cpu_uses_the_kernel(tmp_path) -> None:
    engine = make_engine(build_tiny_model(tmp_path), "paged")
    assert engine.runner.attention.name == "cpu_paged"


@needs_compiler
@pytest.mark.parametrize("head_dim", [16, 64, 128])  # 64 and 128 have their own unrolled loops
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3)])
def test_decode_kernel_for_each_head_size(head_dim, heads, kv_heads) -> None:
    """The kernel path, on scattered pages with a window start, against plain torch."""
    torch.manual_seed(5)
    page, max_pages, batch = 16, 4, 3
    k_pool, v_pool = (torch.randn(40 * page, kv_heads, head_dim) for _ in range(2))
    pages = torch.stack([torch.randperm(40)[:max_pages] for _ in range(batch)])  # [B, pages]
    ctx, lo = torch.tensor([50, 7, 64]), torch.tensor([0, 0, 20])
    q = torch.randn(batch, heads, head_dim)
    out = torch.empty(batch, heads, head_dim)  # [B, H, D]
    rows = DecodeRows(token_idx=None, pages=pages, ctx=ctx, lo=lo, width=int(ctx.max()))
    CpuPagedAttention()._decode(q, k_pool, v_pool, page, 0.125, rows, out)
    for b in range(batch):
        slots = (pages[b, :, None] * page + torch.arange(page)).flatten()[lo[b]:ctx[b]]
        k = k_pool[slots].repeat_interleave(heads // kv_heads, 1)  # [T, H, D]
        v = v_pool[slots].repeat_interleave(heads // kv_heads, 1)
        weights = torch.softmax(torch.einsum("hd,thd->ht", q[b], k) * 0.125, -1)
        torch.testing.assert_close(out[b], torch.einsum("ht,thd->hd", weights, v),
                                   atol=1e-5, rtol=1e-5)
