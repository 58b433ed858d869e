"""The Triton paged attention kernel (engine/attention/paged_kernel.py), run on the CPU through
Triton's interpreter: random pools against a float64 reference (ragged contexts, page sizes,
GQA ratios, windows, soft-capping, shared prefix pages, pages slid past, split key ranges), the
backend against the reference backend on the runner's own metadata, its start-up check and
fallback, and engines serving transformers' greedy tokens through it."""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import engine.attention.select as backends
from engine.attention.reference import ReferenceAttention, reference_attention
from engine.attention.triton_paged import TritonPagedAttention
from engine.runner.attention_check import check_attention_backend, check_or_fall_back
from tests.engine_harness import Req, drive, greedy, hf_greedy, make_engine
from tests.models_fixtures import build_tiny_model
from tests.test_attention_backends import CASES, HEAD_DIM, HEADS, prepare, random_pool
from tests.test_kv_groups import KINDS  # Gemma 3 shaped: 4 block tables over 2 pool tensors

CPU = torch.device("cpu")
FAR = 10**9  # a page id far outside any pool: reading it would fail


@pytest.fixture(scope="module")
def kernel():
    """The kernel module, imported (interpreted on the CPU) by the backend."""
    return TritonPagedAttention(CPU).kernel


def dense(q, k_pool, v_pool, pages, q_start, q_len, ctx, page, scale, window, softcap):
    """Attention of each sequence's queries over its positions, in float64: [N, H, D]."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_pool.shape[1]
    for s in range(len(q_len)):
        n, c, first = int(q_len[s]), int(ctx[s]), int(q_start[s])
        pos = torch.arange(c)  # [c]
        q_pos = torch.arange(c - n, c)[:, None]  # [n, 1]
        seen = pos[None, :] <= q_pos
        if window:
            seen &= pos[None, :] > q_pos - window
        lowest = int(seen.int().argmax(1).min())  # earlier positions are read by no query
        slots = pages[s][pos[lowest:] // page] * page + pos[lowest:] % page
        k = k_pool[slots].double().repeat_interleave(group, 1)  # [c', H, D]
        v = v_pool[slots].double().repeat_interleave(group, 1)
        scores = torch.einsum("nhd,chd->hnc", q[first:first + n].double(), k) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~seen[None, :, lowest:], float("-inf"))
        out[first:first + n] = torch.einsum("hnc,chd->nhd", scores.softmax(-1), v)
    return out


def random_step(rng: random.Random, page: int, seqs: list[tuple[int, int]], kv_heads: int,
                head_dim: int, heads: int, shared: int, window: int | None):
    """A pool of 64 pages or more and sequences (queries, context) on random pages: the second
    shares the first's first `shared` pages; under a window, the pages every query slid past
    are given back (a far id in the table)."""
    torch.manual_seed(rng.randrange(1 << 30))
    num_pages = max(64, sum(-(-c // page) for _, c in seqs))
    k_pool, v_pool = (torch.randn(num_pages * page, kv_heads, head_dim) for _ in range(2))
    width = max(-(-c // page) for _, c in seqs)
    free = list(range(num_pages))
    rng.shuffle(free)
    pages = torch.full((len(seqs), width), FAR, dtype=torch.int64)  # [S, W]
    for s, (_, c) in enumerate(seqs):
        count = -(-c // page)
        own = [free.pop() for _ in range(count)]
        if s == 1 and shared:
            own[:shared] = pages[0, :shared].tolist()
        pages[s, :count] = torch.tensor(own)
    for s, (n, c) in enumerate(seqs):
        if window:  # the pages below the first query's window are given back
            pages[s, :max(0, c - n - window + 1) // page] = FAR
    q_len = torch.tensor([n for n, _ in seqs])
    ctx = torch.tensor([c for _, c in seqs])
    q_start = torch.cat([torch.zeros(1, dtype=torch.int64), q_len.cumsum(0)[:-1]])
    q = torch.randn(int(q_len.sum()), heads, head_dim)
    return q, k_pool, v_pool, pages, q_start, q_len, ctx


def run_kernel(kernel, step, page, window, softcap, block_q, key_tile, split, reference=True):
    q, k_pool, v_pool, pages, q_start, q_len, ctx = step
    counts = (q_len + block_q - 1) // block_q
    cu_blocks = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    out = torch.full_like(q, float("nan"))  # every row must be written
    scale = q.shape[2] ** -0.5
    kernel.paged_attention(q, k_pool, v_pool, out, pages, q_start, q_len, ctx, cu_blocks,
                           int(cu_blocks[-1]) + 3, page, scale, window, softcap, block_q,
                           key_tile, split)
    if not reference:
        return out, None
    return out, dense(q, k_pool, v_pool, pages, q_start, q_len, ctx, page, scale, window,
                      softcap)


SEQS = [(1, 37), (6, 20), (1, 3), (17, 70), (1, 1), (3, 3)]  # (queries, context): ragged


@pytest.mark.parametrize("page", [16, 32])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (8, 2), (8, 1)])  # GQA 1, 4, 8
@pytest.mark.parametrize("window,softcap", [(None, None), (9, None), (None, 20.0), (5, 30.0)])
def test_kernel_matches_dense_attention(kernel, page, heads, kv_heads, window, softcap) -> None:
    rng = random.Random(page * 100 + heads * 10 + kv_heads + (window or 0))
    step = random_step(rng, page, SEQS, kv_heads, 16, heads, shared=1, window=window)
    block_q = max(1, 64 // heads * kv_heads)
    out, want = run_kernel(kernel, step, page, window, softcap, block_q, 32, split=1)
    torch.testing.assert_close(out.double(), want, atol=5e-6, rtol=0)


@pytest.mark.parametrize("split", [2, 5])
@pytest.mark.parametrize("window", [None, 11])
def test_split_key_ranges_merge_to_the_same_result(kernel, split, window) -> None:
    """Flash-decoding: slices of a long context merged (some slices see nothing)."""
    seqs = [(1, 150), (1, 9), (1, 97), (4, 60)]
    step = random_step(random.Random(split), 8, seqs, 2, 24, 8, shared=2, window=window)
    out, want = run_kernel(kernel, step, 8, window, None, 4, 16, split)
    torch.testing.assert_close(out.double(), want, atol=5e-6, rtol=0)


def test_odd_head_dim_and_rows_no_sequence_names(kernel) -> None:
    """A head dim of 24 (padded to 32 inside) and rows between sequences, which keep their
    values (a padded batch's rows belong to no sequence)."""
    step = random_step(random.Random(7), 16, [(1, 40), (5, 18)], 3, 24, 6, 0, None)
    q, k_pool, v_pool, pages, _, q_len, ctx = step
    q_start = torch.tensor([2, 6])  # rows 0, 1, 3, 4, 5 named by no sequence
    wide_q = torch.randn(11, 6, 24)
    wide_q[2:3], wide_q[6:11] = q[:1], q[1:]
    out = torch.zeros_like(wide_q)
    cu_blocks = torch.tensor([0, 1, 2])
    kernel.paged_attention(wide_q, k_pool, v_pool, out, pages, q_start, q_len, ctx, cu_blocks,
                           4, 16, 0.2, None, None, 8, 16, 1)
    want = dense(wide_q, k_pool, v_pool, pages, q_start, q_len, ctx, 16, 0.2, None, None)
    torch.testing.assert_close(out.double(), want, atol=5e-6, rtol=0)
    assert not out[[0, 1, 3, 4, 5]].any()


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"bs{c[0]}-w{c[1]}-shared{c[3]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backend_matches_the_reference_on_runner_metadata(case, dtype) -> None:
    block_size, window, shapes, shared = case
    backend = TritonPagedAttention(CPU)
    torch.manual_seed(3)
    k, v = random_pool(CPU, dtype)
    with torch.inference_mode():
        meta = prepare(block_size, window, shapes, shared, backend, CPU, seed=3)
        assert meta.decode_mask is None and all(row.mask is None for row in meta.prefills)
        q = torch.randn(meta.slot_mapping.numel(), HEADS, HEAD_DIM).to(dtype)
        want = reference_attention(q.float(), k.float(), v.float(), meta, HEAD_DIM ** -0.5)
        got = backend.forward(q, k, v, meta, HEAD_DIM ** -0.5)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=0)


def test_selection_and_fallback(tmp_path, monkeypatch, caplog) -> None:
    """`triton` runs on the CPU (interpreted); `auto` there stays on the CPU kernels. A kernel
    disagreeing with the reference stops `triton` and makes `auto` fall back, loudly; the
    start-up check covers a window whatever the model's layers use."""
    assert backends.select_attention_backend("triton", CPU).name == "triton"
    assert backends.select_attention_backend("auto", CPU).name != "triton"
    assert backends.fallback_backend(TritonPagedAttention(CPU), CPU).name == "reference"
    engine = make_engine(build_tiny_model(tmp_path), "paged", block_size=4,
                         attention_backend="triton")
    runner = engine.runner
    assert runner.attention.name == "triton"
    assert check_attention_backend(runner) < 1e-5
    kernel = runner.attention.kernel
    real = kernel.paged_attention

    def off_in_windows(*args):  # right without a window, wrong with one
        real(*args)
        if args[12] is not None:
            args[3].mul_(1.5)

    monkeypatch.setattr(kernel, "paged_attention", off_in_windows)
    with pytest.raises(ValueError, match="attention_backend='triton'.*start-up check"):
        check_or_fall_back(runner, "triton")
    with caplog.at_level(logging.WARNING):
        assert not check_or_fall_back(runner, "auto")
    assert type(runner.attention) is ReferenceAttention
    assert "triton failed its start-up check" in caplog.text


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("triton"), arch="llama")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(5)
    prefix = [rng.randrange(3, 200) for _ in range(13)]
    prompts = [prefix + [rng.randrange(3, 200) for _ in range(n)] for n in (0, 6)]
    prompts += [[rng.randrange(3, 200) for _ in range(n)] for n in (1, 25, 9)]
    new_tokens = [8, 12, 6, 10, 7]
    refs = [hf_greedy(model, p, n) for p, n in zip(prompts, new_tokens, strict=True)]
    return path, prompts, new_tokens, refs


ENGINE_CASES = {
    "none": ("none", {}),
    "dynamic": ("dynamic", {}),
    "continuous": ("continuous", {}),
    "paged-chunks-prefix": ("paged", {"max_num_batched_tokens": 5, "block_size": 4,
                                      "enable_prefix_caching": True}),
    "paged-preemption": ("paged", {"block_size": 4, "num_kv_blocks": 14, "max_num_seqs": 5,
                                   "max_num_batched_tokens": 16}),
    "paged-padded-decode": ("paged", {"padded_decode_on_cpu": True}),
}


@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_engines_serve_transformers_tokens_through_the_kernel(tiny, case) -> None:
    path, prompts, new_tokens, refs = tiny
    batching, options = ENGINE_CASES[case]
    engine = make_engine(path, batching, attention_backend="triton", **options)
    assert engine.runner.attention.name == "triton"
    reqs = [Req(f"r{i}", p, greedy(n), i) for i, (p, n) in enumerate(zip(prompts, new_tokens,
                                                                          strict=True))]
    drive(engine, reqs)
    assert [r.tokens for r in reqs] == refs
    if case == "paged-preemption":
        assert engine.scheduler.num_preemptions > 0
    if case == "paged-chunks-prefix":
        assert engine.scheduler.allocator.prefix_hits > 0
    if case == "paged-padded-decode":  # the padded (graph) path read the pool in place
        padded = engine.runner.padded_decode
        assert padded.steps > 0 and padded.attention is engine.runner.attention




@pytest.mark.parametrize("arch,options", [
    ("gemma3", {"num_hidden_layers": 7, "layer_types": KINDS}),
    ("gemma2", {"attn_logit_softcapping": 0.5}),  # capped hard enough to matter; windows
])
def test_windows_groups_and_soft_capping_serve_transformers_tokens(tmp_path, arch,
                                                                   options) -> None:
    path = build_tiny_model(tmp_path, arch=arch, **options)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (23, 5, 14)]
    new_tokens = [20, 16, 12]
    refs = [hf_greedy(model, p, n) for p, n in zip(prompts, new_tokens, strict=True)]
    engine = make_engine(path, "paged", attention_backend="triton", block_size=4,
                         max_num_batched_tokens=8, enable_prefix_caching=True)
    if arch == "gemma3":
        assert engine.runner.layout.num_tables == 4
    reqs = [Req(f"r{i}", p, greedy(n), 2 * i)
            for i, (p, n) in enumerate(zip(prompts, new_tokens, strict=True))]
    drive(engine, reqs)
    assert [r.tokens for r in reqs] == refs


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA_TOLERANCE = {torch.float32: 5e-6, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def long_contexts_case(kernel, device: torch.device, dtype: torch.dtype, split: int) -> None:
    """GQA 4 over long contexts beside a prompt chunk, head dim 64, with and without a
    window or soft-capping, on `device` in `dtype`, against float64 on the CPU."""
    rng = random.Random(split)
    seqs = [*SEQS, (1, 900), (40, 300)]
    step = random_step(rng, 16, seqs, 2, 64, 8, shared=1, window=None)
    moved = [t.to(device, dtype) if t.is_floating_point() else t.to(device) for t in step]
    for window, softcap in ((None, None), (33, None), (None, 20.0)):
        out, _ = run_kernel(kernel, moved, 16, window, softcap, 16, 32, split, reference=False)
        want = dense(*(t.cpu().double() if t.is_floating_point() else t.cpu() for t in moved),
                     16, 64 ** -0.5, window, softcap)
        torch.testing.assert_close(out.cpu().double(), want, atol=CUDA_TOLERANCE[dtype],
                                   rtol=CUDA_TOLERANCE[dtype])


def test_long_contexts_on_the_cpu(kernel) -> None:
    """The GPU test's case, interpreted (so that its own code is proven here too)."""
    long_contexts_case(kernel, CPU, torch.float32, 3)


@needs_cuda
@pytest.mark.parametrize("dtype", list(CUDA_TOLERANCE))
@pytest.mark.parametrize("split", [1, 4])
def test_compiled_kernel_on_cuda_matches_dense_attention(kernel_cuda, dtype, split) -> None:
    """The same checks, compiled for the GPU: every dtype (fp32 through IEEE products, not
    tf32), split key ranges."""
    long_contexts_case(kernel_cuda, torch.device("cuda"), dtype, split)


@pytest.fixture(scope="module")
def kernel_cuda():
    return TritonPagedAttention(torch.device("cuda")).kernel


@needs_cuda
@pytest.mark.parametrize("batching", ["continuous", "paged"])
def test_cuda_engine_with_graphs_gives_generate_greedy_tokens(tiny, batching) -> None:
    """float32 on the GPU with whole-step and piecewise graphs replaying the kernel."""
    path, prompts, new_tokens, refs = tiny
    engine = make_engine(path, batching, device="cuda", attention_backend="triton",
                         max_num_batched_tokens=16 if batching == "paged" else None)
    assert engine.runner.attention.name == "triton"
    assert engine.runner.padded_decode.attention is engine.runner.attention
    reqs = [Req(f"r{i}", p, greedy(n), i) for i, (p, n) in enumerate(zip(prompts, new_tokens,
                                                                          strict=True))]
    drive(engine, reqs)
    assert [r.tokens for r in reqs] == refs
    assert engine.runner.padded_decode.steps > 0


def test_a_fresh_process_settles_the_interpreter_before_the_tokenizer_imports_triton(
        tiny) -> None:
    """Outside this test session (whose conftest chooses the interpreter), loading a tokenizer
    imports torch's compiler, which imports Triton compiled: the engine settles Triton's mode
    for its device first, so `triton` on the CPU starts and serves."""
    path, prompts, new_tokens, refs = tiny
    script = (
        "import sys; from engine import EngineConfig, LLMEngine, SamplingParams\n"
        f"engine = LLMEngine.from_config(EngineConfig(model={str(path)!r}, batching='paged', "
        "max_num_seqs=2, device='cpu', dtype='float32', attention_backend='triton', "
        "max_model_len=96))\n"
        f"engine.add_request('r', {prompts[0]!r}, SamplingParams(max_new_tokens="
        f"{new_tokens[0]}, min_new_tokens={new_tokens[0]}))\n"
        "tokens = []\n"
        "while engine.has_unfinished():\n"
        "    tokens += [e.token_id for e in engine.step() if e.token_id is not None]\n"
        "print(engine.runner.attention.name, tokens)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, cwd=Path(__file__).parent.parent, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == f"triton {refs[0]}"
