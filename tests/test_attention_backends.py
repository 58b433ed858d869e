"""Attention backends against the reference: the flex backend on random pools and block tables,
and end to end through the engine. CPU compiles FlexAttention to C++ (seconds per shape), so the
cases share one pool size and a few query buckets (16-row blocks per sequence: 64 and 128) to
compile only a few graphs. CI has no GPU: how the GPU kernel reads the BlockMask is emulated in
plain PyTorch (kernel_reads) and compared with the reference too."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from torch._dynamo.utils import counters

import engine.attention.explicit as explicit
from engine.attention.explicit import explicit_attention
from engine.attention.flex import QUERY_BLOCK, FlexAttention
from engine.attention.reference import (
    AttentionBackend,
    AttentionMetadata,
    ReferenceAttention,
    reference_attention,
    split_by_width,
)
from engine.attention.select import select_attention_backend
from engine.models.spec import ModelSpec
from engine.runner.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler.base import ScheduledBatch
from engine.sequence import Sequence
from tests.engine_harness import Req, drive, greedy, make_engine
from tests.models_fixtures import build_tiny_model

POOL_SLOTS = 384  # every case uses this pool size, so compiled graphs are reused
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16

# (block_size, sliding_window, [(computed tokens, scheduled tokens) per sequence], shared blocks)
CASES = [
    (4, None, [(5, 1), (0, 7), (9, 1), (12, 4), (0, 1), (30, 1)], 0),
    (4, 5, [(6, 1), (0, 9), (2, 1), (3, 3), (17, 1)], 0),
    (16, None, [(40, 1), (33, 6), (0, 20), (2, 1)], 2),  # first 2 blocks shared (prefix cache)
    (16, 7, [(40, 1), (0, 13), (21, 8), (15, 1)], 0),
    (12, None, [(30, 1), (0, 14), (25, 6), (3, 1)], 1),  # pages of 12 straddle flex's 16
    (24, 6, [(40, 1), (0, 20), (30, 5)], 0),
    (96, None, [(50, 1), (0, 17), (60, 9), (7, 1)], 0),  # contiguous: one block per sequence
    (96, 10, [(50, 1), (0, 17), (60, 9), (7, 1)], 0),
]


def pool_runner(backend, device: torch.device, num_blocks: int, block_size: int,
                window: int | None = None, max_positions: int = 256) -> ModelRunner:
    """A model-less ModelRunner over a float32 pool of `num_blocks` (and its scratch block)."""
    spec = ModelSpec("LlamaForCausalLM", 1, HEADS * HEAD_DIM, HEADS, KV_HEADS, HEAD_DIM, 100,
                     max_positions, window)
    return ModelRunner(None, spec, device, torch.float32, num_blocks, block_size, backend)


def prepare(block_size: int, window: int | None, shapes: list[tuple[int, int]], shared: int,
            backend, device: torch.device, seed: int) -> AttentionMetadata:
    """The real ModelRunner.stage's metadata for a batch with random block tables."""
    rng = random.Random(seed)
    runner = pool_runner(backend, device, POOL_SLOTS // block_size, block_size, window)
    free = list(range(POOL_SLOTS // block_size))
    rng.shuffle(free)
    seqs = []
    for i, (computed, n) in enumerate(shapes):
        seq = Sequence(i, [rng.randrange(3, 99) for _ in range(computed + n)], SamplingParams())
        seq.num_computed_tokens = computed
        table = seqs[0].block_table[:shared] if i == 1 else []
        seq.block_table = table + [free.pop() for _ in range(-(-seq.num_tokens // block_size)
                                                             - len(table))]
        seqs.append(seq)
    batch = ScheduledBatch(tuple(seqs), tuple(n for _, n in shapes))
    return runner.attention_metadata(batch)


def random_pool(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V pools made as ModelRunner makes its pool: outside inference mode (dynamo compiles
    inference and normal tensors to different graphs, so tests then share the engine's)."""
    return tuple(torch.randn(POOL_SLOTS, KV_HEADS, HEAD_DIM, device=device).to(dtype)
                 for _ in range(2))


def compare(case, device: torch.device, dtype: torch.dtype, atol: float, seed: int) -> None:
    block_size, window, shapes, shared = case
    backend = FlexAttention(device)
    torch.manual_seed(seed)
    k, v = random_pool(device, dtype)
    with torch.inference_mode():
        meta = prepare(block_size, window, shapes, shared, backend, device, seed)
        q = torch.randn(meta.slot_mapping.numel(), HEADS, HEAD_DIM, device=device).to(dtype)
        want = reference_attention(q.float(), k.float(), v.float(), meta, HEAD_DIM ** -0.5)
        got = backend.forward(q, k, v, meta, HEAD_DIM ** -0.5)
    assert got.shape == q.shape
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"bs{c[0]}-w{c[1]}-shared{c[3]}")
def test_flex_matches_reference_on_cpu(case) -> None:
    compare(case, torch.device("cpu"), torch.float32, 1e-5, seed=CASES.index(case))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"bs{c[0]}-w{c[1]}-shared{c[3]}")
def test_flex_matches_reference_on_gpu_bf16(case) -> None:
    compare(case, torch.device("cuda"), torch.bfloat16, 2e-2, seed=CASES.index(case))


def test_steady_decoding_does_not_recompile() -> None:
    """Decode steps of 9..16 sequences (one query bucket: a block of 16 rows each) with
    growing contexts reuse one compiled graph."""
    backend = FlexAttention(torch.device("cpu"))
    k, v = random_pool(torch.device("cpu"), torch.float32)
    graphs = None
    for step in range(8):
        shapes = [(3 + step + i, 1) for i in range(9 + step * 5 % 8)]
        q = torch.randn(len(shapes), HEADS, HEAD_DIM)
        with torch.inference_mode():
            meta = prepare(4, None, shapes, 0, backend, torch.device("cpu"), seed=step)
            got = backend.forward(q, k, v, meta, 0.25)
            torch.testing.assert_close(got, reference_attention(q, k, v, meta, 0.25), atol=1e-5,
                                       rtol=0)
        if graphs is None:  # the first step may compile the 256-row bucket
            graphs = counters["stats"]["unique_graphs"]
            # Contexts 4..12 fill at most 3 pages of 4 slots: each block reads at most 3 of the
            # pool's 24 KV blocks, its own sequence's.
            assert meta.backend_state.block_mask.kv_num_blocks.max() <= 3
    assert counters["stats"]["unique_graphs"] == graphs


def _sequence_pages(meta: AttentionMetadata) -> list[list[int]]:
    """Each step sequence's pages, in flex's numbering: the decodes, then the prefills."""
    decodes = [] if meta.decode_pages is None else meta.decode_pages.tolist()
    return decodes + [row.kv_pages.tolist() for row in meta.prefills]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"bs{c[0]}-w{c[1]}-shared{c[3]}")
def test_each_query_block_reads_only_its_own_sequences_kv_blocks(case) -> None:
    """The BlockMask's lists as the GPU kernel reads them (no compile): every query block holds
    one sequence's rows and lists each KV block of its sequence's pages at most once, every
    one its rows see among them; padding blocks list none. (On the GPU a block shared by 16
    decode rows made one kernel program walk all their pages.)"""
    block_size, window, shapes, shared = case
    backend = FlexAttention(torch.device("cpu"))
    with torch.inference_mode():
        meta = prepare(block_size, window, shapes, shared, backend, torch.device("cpu"),
                       seed=CASES.index(case))
    step, g = meta.backend_state, meta.page_size
    counts, table = backend._kv_blocks(step, POOL_SLOTS // 16, g)
    pages = _sequence_pages(meta)
    seqs, lo, pos = (t.view(-1, 16).tolist() for t in (step.q_seq, step.q_lo, step.q_pos))
    assert counts.numel() == len(seqs) == step.q_seq.numel() // 16
    used = 0
    for block, count in enumerate(counts.tolist()):
        real = [i for i in range(16) if pos[block][i] >= 0]
        listed = table[block, :count].tolist()
        if not real:
            assert count == 0
            continue
        used += 1
        (seq,) = {seqs[block][i] for i in real}
        own = {(p * g + s) // 16 for p in pages[seq][:-(-(max(pos[block]) + 1) // g)]
               for s in (0, g - 1)}
        seen = {(pages[seq][x // g] * g + x % g) // 16
                for i in real for x in range(lo[block][i], pos[block][i] + 1)}
        assert len(set(listed)) == len(listed) and seen <= set(listed) <= own
    assert used == sum(-(-n // 16) for _, n in shapes)  # a block per 16 rows of a sequence


def kernel_reads(block_mask, q_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """What FlexAttention's Triton kernel computes from a BlockMask, in plain PyTorch: each
    query block reads the first kv_num_blocks of its listed KV blocks, but no more than the
    keys hold (the kernel's loop bound), mask_mod applied. q_rows [Q, H, D] -> [Q, H, D]."""
    counts, lists = block_mask.kv_num_blocks[0, 0].tolist(), block_mask.kv_indices[0, 0]
    num_slots, kv_block = k.shape[0], block_mask.BLOCK_SIZE[1]
    k, v = (t.repeat_interleave(q_rows.shape[1] // t.shape[1], 1) for t in (k, v))
    out = torch.zeros_like(q_rows)
    for block, count in enumerate(counts):
        rows = torch.arange(block * QUERY_BLOCK, (block + 1) * QUERY_BLOCK)
        read = lists[block, :min(count, -(-num_slots // kv_block))].tolist()
        if not read:
            continue
        slots = torch.tensor([b * kv_block + i for b in read for i in range(kv_block)],
                             dtype=torch.long)
        inside = slots.clamp(max=num_slots - 1)  # a last partial block reads past the keys
        seen = block_mask.mask_mod(0, 0, rows[:, None], inside[None]) & (slots < num_slots)
        scores = torch.einsum("qhd,khd->hqk", q_rows[rows], k[inside])
        probs = (scale * scores).masked_fill(~seen, float("-inf")).softmax(-1).nan_to_num(0)
        out[rows] = torch.einsum("hqk,khd->qhd", probs, v[inside])
    return out


def gpu_flex(backend: FlexAttention, meta: AttentionMetadata, q: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The flex backend's output as the GPU kernel would compute it (no compile), from lists
    as the kernel loads them: int32, contiguous, no count past its loop bound."""
    step = meta.backend_state
    step.block_mask = backend._block_mask(step, k.shape[0], meta.page_size)
    counts, lists = step.block_mask.kv_num_blocks, step.block_mask.kv_indices
    assert counts.dtype == lists.dtype == torch.int32
    assert counts.is_contiguous() and lists.is_contiguous()
    assert int(counts.max()) <= -(-k.shape[0] // step.block_mask.BLOCK_SIZE[1])
    q_rows = q.new_zeros(step.q_seq.numel(), *q.shape[1:]).index_copy_(0, step.token_rows, q)
    return kernel_reads(step.block_mask, q_rows, k, v, scale).index_select(0, step.token_rows)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"bs{c[0]}-w{c[1]}-shared{c[3]}")
def test_the_gpu_kernels_reading_of_the_block_mask_matches_the_reference(case) -> None:
    """CI has no GPU: the kernel's reading of the lists, emulated, against the reference."""
    backend = FlexAttention(torch.device("cpu"))
    torch.manual_seed(CASES.index(case))
    k, v = random_pool(torch.device("cpu"), torch.float32)
    with torch.inference_mode():
        meta = prepare(*case, backend, torch.device("cpu"), seed=CASES.index(case))
        q = torch.randn(meta.slot_mapping.numel(), HEADS, HEAD_DIM)
        want = reference_attention(q, k, v, meta, 0.25)
        torch.testing.assert_close(gpu_flex(backend, meta, q, k, v, 0.25), want, atol=1e-5,
                                   rtol=0)


def test_on_cuda_flex_runs_the_kernel_that_kernel_reads_emulates() -> None:
    """kernel_reads emulates torch's main Triton template: a program per 16-row query block
    and head. Below 128 query rows torch would pick flex_decoding instead, which packs several
    heads' rows into a program and picks its mask row another way, untried with this layout:
    the CUDA options pin the main kernel, with tiles equal to the BlockMask's blocks."""
    options = FlexAttention(torch.device("cuda"), kv_block=16).kernel_options
    assert options == {"BLOCK_M": QUERY_BLOCK, "BLOCK_N": 16, "BACKEND": "TRITON"}
    assert FlexAttention(torch.device("cpu")).kernel_options is None  # one kernel on CPU


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("computed,scheduled,num_seqs,dtype", [
    (600, 1, 1, torch.float32), (592, 8, 1, torch.float32), (200, 1, 1, torch.float32),
    (600, 1, 2, torch.bfloat16)])  # two decodes side by side, as a served bf16 model's
def test_a_window_slid_past_more_pages_than_the_pool_holds(device, block_size, computed,
                                                           scheduled, num_seqs, dtype) -> None:
    """A windowed table names the scratch block for every page its sequence slid past (a
    model whose every layer has the window serves sequences longer than the pool). Listed
    once per such page, the scratch block filled the kernel's loop bound before the visible
    pages came (found in review): each block's list starts at its first visible page. On CPU
    the GPU kernel's reading is emulated; on CUDA the real kernel runs."""
    window, num_blocks, device = 16, 96 // block_size, torch.device(device)
    backend = FlexAttention(device)
    backend.reserve(4, 1024)
    runner = pool_runner(backend, device, num_blocks, block_size, window, max_positions=4096)
    total, pages = computed + scheduled, -(-(computed + scheduled) // block_size)
    held = pages - (computed - window + 1) // block_size
    scratch = num_blocks  # BlockManager.outside_window: the runner's scratch block
    seqs = []
    for i in range(num_seqs):  # each holds its own last pages, the rest name the scratch block
        seq = Sequence(i, [5] * total, SamplingParams())
        seq.num_computed_tokens = computed
        seq.block_table = [scratch] * (pages - held) + list(range(i * held, (i + 1) * held))
        seqs.append(seq)
    slots = (num_blocks + 1) * block_size
    torch.manual_seed(block_size + computed)
    k, v = (torch.randn(slots, KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
            for _ in range(2))
    with torch.inference_mode():
        meta = runner.attention_metadata(ScheduledBatch(tuple(seqs), (scheduled,) * num_seqs))
        q = torch.randn(scheduled * num_seqs, HEADS, HEAD_DIM, device=device, dtype=dtype)
        got = (gpu_flex(backend, meta, q, k, v, 0.25) if device.type == "cpu"
               else backend.forward(q, k, v, meta, 0.25))
        want = reference_attention(q.float(), k.float(), v.float(), meta, 0.25)
    tolerance = (2e-2 if dtype == torch.bfloat16 else 1e-5 if device.type == "cpu" else 1e-4)
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=0)
    counts = meta.backend_state.block_mask.kv_num_blocks
    assert counts.max() <= -(-(window + scheduled) // 16) + 1  # the window's blocks, not ctx's


def test_flex_steps_build_no_masks_it_does_not_read() -> None:
    """Flex bounds rows by position and window: the runner builds no prompt or decode masks
    for it (tensor ops on a GPU step's critical path), where the reference gets both."""
    shapes = [(40, 1), (21, 8), (0, 13)]  # a decode, a chunk after a prefix, a prompt
    for backend, built in ((FlexAttention(torch.device("cpu")), False),
                           (ReferenceAttention(), True)):
        with torch.inference_mode():
            meta = prepare(16, 7, shapes, 0, backend, torch.device("cpu"), seed=1)
        assert all((row.mask is not None) is built for row in meta.prefills)
        assert (meta.decode_mask is not None) is built


def test_tables_take_their_reserved_width_and_grow_past_it_loudly(caplog) -> None:
    """reserve(): the per-sequence tables are as wide as max_model_len's pages from the first
    step (so start-up compiles serve every step); a longer sequence widens them, logged."""
    backend = FlexAttention(torch.device("cpu"))
    backend.reserve(4, 100)  # 25 pages of 4 slots: 32 wide
    with torch.inference_mode(), caplog.at_level(logging.INFO, "engine.attention.flex"):
        meta = prepare(4, None, [(5, 1), (0, 7)], 0, backend, torch.device("cpu"), seed=0)
        assert meta.backend_state.max_pages == 32 and "grown" not in caplog.text
        meta = prepare(4, None, [(150, 1)], 0, backend, torch.device("cpu"), seed=0)
    assert meta.backend_state.max_pages == 64  # 38 pages
    assert "per-sequence table grown to 64 pages" in caplog.text


def test_selection() -> None:
    cpu = torch.device("cpu")
    assert isinstance(select_attention_backend("reference", cpu), ReferenceAttention)
    assert isinstance(select_attention_backend("flex", cpu), FlexAttention)
    with pytest.raises(ValueError, match="attention_backend"):
        select_attention_backend("flash", cpu)


@pytest.mark.parametrize("arch", ["llama", "mistral"])  # mistral: sliding window 12
def test_flex_engine_gives_reference_greedy_tokens(tmp_path, arch) -> None:
    """A short paged workload (chunked prefill, prefix cache, block size 4): same tokens."""
    path = build_tiny_model(tmp_path, arch=arch)
    rng = random.Random(5)
    shared = [rng.randrange(3, 300) for _ in range(9)]
    prompts = [shared + [rng.randrange(3, 300) for _ in range(n)] for n in (2, 14)]
    prompts += [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 21)]
    tokens = {}
    for backend in ("reference", "flex"):
        reqs = [Req(f"r{i}", p, greedy(12), i) for i, p in enumerate(prompts)]
        engine = make_engine(path, "paged", block_size=4, max_num_batched_tokens=16,
                             enable_prefix_caching=True, attention_backend=backend)
        assert engine.runner.attention.name == backend
        drive(engine, reqs)
        tokens[backend] = [r.tokens for r in reqs]
    assert tokens["flex"] == tokens["reference"]


class _OffByOne(AttentionBackend):
    """A backend that is wrong: what a miscompiled kernel would look like."""

    name = "broken"

    def forward(self, q, k_cache, v_cache, meta, scale):
        return reference_attention(q, k_cache, v_cache, meta, scale) + 1.0


def test_a_backend_that_disagrees_is_caught_at_start_up(tmp_path) -> None:
    """auto falls back to the reference; a backend asked for by name stops start-up."""
    from engine.runner.attention_check import check_or_fall_back

    engine = make_engine(build_tiny_model(tmp_path), "paged", block_size=4)
    runner = engine.runner
    runner.attention = _OffByOne()
    with pytest.raises(ValueError, match="failed its start-up check"):
        check_or_fall_back(runner, "flex")
    check_or_fall_back(runner, "auto")
    assert type(runner.attention) is ReferenceAttention
    assert not runner.kv_cache.any(), "the check left values in the pool"


def test_the_start_up_check_sees_decode_blocks_read_the_wrong_sequence(monkeypatch) -> None:
    """Its synthetic step holds two decodes beside a chunk: a layout slip between decode
    blocks (here each reads the first decode's pages) fails it on the real kernel."""
    from engine.runner.attention_check import check_attention_backend

    prepare_step = FlexAttention.prepare

    def first_decodes_pages(self, meta):
        step = prepare_step(self, meta)
        step.block_seq[:meta.decode_token_idx.numel()] = 0
        return step

    runner = pool_runner(FlexAttention(torch.device("cpu")), torch.device("cpu"), 24, 16)
    assert check_attention_backend(runner) < 1e-4
    monkeypatch.setattr(FlexAttention, "prepare", first_decodes_pages)
    with pytest.raises(AssertionError, match="differs from the reference"):
        check_attention_backend(runner)


def test_split_by_width_cuts_only_where_padding_costs_more_than_a_group() -> None:
    assert split_by_width([2] * 10 + [18] * 10, 32, 4) == [0, 10, 20]
    assert split_by_width([5] * 32, 32, 4) == [0, 32]  # equal lengths: nothing to save
    assert split_by_width([3, 9], 32, 4) == [0, 2]  # saving 6 cells is not worth a group
    assert split_by_width([1] * 20 + [30], 32, 4) == [0, 20, 21]
    bounds = split_by_width(list(range(1, 200)), 8, 3)
    assert len(bounds) == 4 and bounds == sorted(bounds)  # never more than max_groups


@pytest.mark.parametrize("window", [None, 5])
def test_grouped_decode_rows_give_the_ungrouped_result(window) -> None:
    """Rows of very different lengths are attended in groups; each row's output is unchanged."""
    shapes = [(2, 1), (3, 1), (90, 1), (0, 6), (4, 1), (85, 1), (1, 1), (80, 1), (2, 1)]
    cpu = torch.device("cpu")
    backend = ReferenceAttention()
    torch.manual_seed(0)
    k, v = random_pool(cpu, torch.float32)
    with torch.inference_mode():
        meta = prepare(4, window, shapes, 0, backend, cpu, seed=3)
        groups = meta.backend_state
        q = torch.randn(meta.slot_mapping.numel(), HEADS, HEAD_DIM)
        grouped = backend.forward(q, k, v, meta, HEAD_DIM ** -0.5)
        whole = reference_attention(q, k, v, meta, HEAD_DIM ** -0.5)
    assert len(groups) == 2 and sorted(len(g.token_idx) for g in groups) == [3, 5]
    assert max(g.pages.shape[1] for g in groups) == meta.decode_pages.shape[1]
    torch.testing.assert_close(grouped, whole, atol=1e-6, rtol=1e-6)


def test_warm_up_buckets_cover_the_step_sizes_up_to_the_limits() -> None:
    from engine.runner.attention_check import WARM_UP_MAX_ROWS, warm_up_buckets

    assert warm_up_buckets(512, 10**6) == [16, 32, 64, 128, 256, 512]
    assert warm_up_buckets(100, 10**6) == [16, 32, 64, 128]  # 100 tokens pad to 128
    assert warm_up_buckets(10**6, 10**6)[-1] == WARM_UP_MAX_ROWS
    assert warm_up_buckets(512, 64) == [16, 32, 64]  # no bucket larger than the pool


def test_warm_up_runs_each_bucket_and_leaves_the_pool_untouched(tmp_path) -> None:
    from engine.runner.attention_check import warm_up_attention

    engine = make_engine(build_tiny_model(tmp_path), "paged", block_size=4)
    calls = []
    forward = engine.runner.attention.forward

    def counting(q, *args):
        calls.append(q.shape[0])
        return forward(q, *args)

    engine.runner.attention.forward = counting
    assert warm_up_attention(engine.runner, 64) == [16, 32, 64] == calls
    assert not engine.runner.kv_cache.any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flex_on_gpu_compiles_at_start_up_not_while_serving(tmp_path) -> None:
    """After from_config, steps of any size up to the token budget reuse compiled graphs."""
    path = build_tiny_model(tmp_path)
    engine = make_engine(path, "paged", device="cuda", attention_backend="flex",
                         max_num_seqs=20, max_num_batched_tokens=64)
    assert engine.runner.attention.name == "flex"
    graphs = counters["stats"]["unique_graphs"]
    rng = random.Random(3)
    reqs = [Req(f"r{i}", [rng.randrange(3, 300) for _ in range(rng.randrange(1, 40))],
                greedy(rng.randrange(1, 12)), rng.randrange(0, 8)) for i in range(20)]
    drive(engine, reqs)
    assert counters["stats"]["unique_graphs"] == graphs, "a step compiled while serving"


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"bs{c[0]}-w{c[1]}-shared{c[3]}")
@pytest.mark.parametrize("budget", [1 << 24, 1], ids=["whole", "query-by-query"])
def test_explicit_attention_matches_reference_and_applies_a_layer_window(case, budget,
                                                                         monkeypatch) -> None:
    """The transformers fallback's explicit path (soft-capping, per-layer windows) equals the
    reference without a cap, with the step's window or with a layer window of its own; also
    when a prefill's queries go in chunks (a score budget of 1: one query at a time)."""
    monkeypatch.setattr(explicit, "SCORE_BUDGET", budget)
    block_size, window, shapes, shared = case
    seed = CASES.index(case)
    torch.manual_seed(seed)
    k, v = random_pool(torch.device("cpu"), torch.float32)
    with torch.inference_mode():
        meta = prepare(block_size, window, shapes, shared, None, torch.device("cpu"), seed)
        q = torch.randn(meta.slot_mapping.numel(), HEADS, HEAD_DIM)
        want = reference_attention(q, k, v, meta, 0.3)
        got = explicit_attention(q, k, v, meta, 0.3, None, window)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        if window is None:  # a layer window where the step has none: the step with one
            windowed = prepare(block_size, 5, shapes, shared, None, torch.device("cpu"), seed)
            torch.testing.assert_close(explicit_attention(q, k, v, meta, 0.3, None, 5),
                                       reference_attention(q, k, v, windowed, 0.3),
                                       atol=1e-5, rtol=0)
        capped = explicit_attention(q, k, v, meta, 0.3, 0.5, window)  # scores within ±0.5
        assert not torch.allclose(capped, got) and torch.isfinite(capped).all()
