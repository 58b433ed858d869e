"""The graph-shaped decode path on CPU: the static buffers, bucket padding and scratch block that
CUDA graphs replay, run eagerly here and compared with the plain path (#17 item 5)."""

from __future__ import annotations

import json
import logging
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from engine import SamplingParams
from engine.kv.layout import shared_layout
from engine.runner import model_runner
from engine.runner.graphs import setup as graphs_setup
from engine.runner.graphs.check import check_padded_decode
from engine.runner.graphs.setup import capture_within_memory, prepare_decode_graphs
from engine.runner.graphs.whole_step import (
    PaddedDecode,
    batch_buckets,
    graph_rows,
    width_buckets,
)
from engine.runner.step_plan import token_rows
from tests.engine_harness import (
    MAX_MODEL_LEN,
    Req,
    drive,
    greedy,
    hf_greedy,
    make_engine,
    padded_in_use,
    staggered_requests,
)
from tests.models_fixtures import build_tiny_model

STRATEGIES = ["none", "dynamic", "continuous", "paged"]


@pytest.fixture(scope="module", params=["llama", "mistral", "gemma3"])
def tiny(request, tmp_path_factory):
    """(model dir, staggered requests) for an architecture without a sliding window, with one
    for every layer, and with a sliding and a full layer (their own metadata each)."""
    path = build_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (1, 5, 17, 33, 9)]
    new_tokens = [12, 30, 16, 7, 40]
    refs = [hf_greedy(model, p, n) for p, n in zip(prompts, new_tokens, strict=True)]
    return path, prompts, new_tokens, refs


def layer_types_of(path) -> list[str]:
    config = json.loads((path / "config.json").read_text())
    return config.get("layer_types") or config.get("text_config", {}).get("layer_types") or []


def padded_engine(path, batching: str, rows: int | None = None, **overrides):
    engine = make_engine(path, batching, **overrides)
    config = engine.config
    rows = rows or graph_rows(config.max_num_seqs,  # as the engine sizes it on CUDA
                              config.max_num_batched_tokens or config.max_num_seqs * MAX_MODEL_LEN)
    padded = padded_in_use(engine.runner, rows, MAX_MODEL_LEN,
                                                max_num_seqs=config.max_num_seqs)
    return engine, recorded(padded)


def recorded(padded: PaddedDecode) -> list[tuple[int, int]]:
    """The (rows, width) of every step `padded` runs from now on, before its bucket."""
    calls = []
    run = padded.run
    padded.run = lambda *args: calls.append(tuple(args[2].shape[1:])) or run(*args)
    return calls


def requests(prompts, new_tokens, sampled: bool = False) -> list[Req]:
    reqs = staggered_requests(prompts, new_tokens, [0, 0, 2, 5, 6])
    if sampled:
        reqs[1].params = SamplingParams(max_new_tokens=30, do_sample=True, seed=5, top_k=40,
                                        top_p=0.9, temperature=0.7, ignore_eos=True)
        reqs[4].params = SamplingParams(max_new_tokens=40, repetition_penalty=1.2,
                                        ignore_eos=True)
    return reqs


@pytest.mark.parametrize("batching", STRATEGIES)
def test_padded_decode_equals_transformers_in_every_strategy(tiny, batching) -> None:
    path, prompts, new_tokens, refs = tiny
    engine, calls = padded_engine(path, batching)
    reqs = requests(prompts, new_tokens)
    drive(engine, reqs)
    assert [r.tokens for r in reqs] == refs
    assert calls, "no step took the padded path"
    if batching != "none":  # steps of 3 rows ran padded (bucket 4, one padding row)
        assert 3 in {rows for rows, _ in calls}


def sampled_tokens(engine, prompts, new_tokens) -> list[list[int]]:
    """The tokens `engine` gives the staggered requests, two of them sampled or penalised."""
    reqs = requests(prompts, new_tokens, sampled=True)
    drive(engine, reqs)
    return [r.tokens for r in reqs]


@pytest.mark.parametrize("batching", ["continuous", "paged"])
def test_padded_decode_equals_the_plain_path_for_sampled_rows(tiny, batching) -> None:
    path, prompts, new_tokens, _ = tiny
    plain = sampled_tokens(make_engine(path, batching), prompts, new_tokens)
    engine, calls = padded_engine(path, batching)
    assert sampled_tokens(engine, prompts, new_tokens) == plain and calls


@pytest.mark.parametrize("batching", ["continuous", "paged"])
def test_prompt_chunks_run_as_padded_rows_and_equal_transformers(tiny, batching) -> None:
    """Steps that carry prompt tokens run padded too, each token a row: beside decodes, and
    (paged, 8-token steps) as a chunk that samples nothing yet; past the largest bucket,
    eagerly. (A one-token prompt packs as a decode row: the first step is already mixed.)"""
    path, prompts, new_tokens, refs = tiny
    # 8 rows at most: paged by its 8-token steps, continuous (whole prompts) by a smaller
    # largest bucket than graph_rows would give it
    chunked = {"max_num_batched_tokens": 8} if batching == "paged" else {"rows": 8}
    engine, calls = padded_engine(path, batching, **chunked)
    runner, kinds = engine.runner, set()
    choose = runner._padded

    def spy(plan):
        taken = choose(plan)
        if plan.prefills:
            unsampled = any(row + n - 1 not in plan.sample_rows for row, n, _, _ in plan.prefills)
            kinds.add(("mixed" if plan.decodes else "prompts",
                       "partial" if unsampled else "sampling", taken))
        return taken
    runner._padded = spy
    reqs = requests(prompts, new_tokens)
    drive(engine, reqs)
    assert [r.tokens for r in reqs] == refs
    assert ("mixed", "sampling", True) in kinds, kinds
    if batching == "paged":
        assert ("mixed", "partial", True) in kinds, kinds
    else:  # the 33-token prompt at once: more rows than the largest bucket (8), eager
        assert ("mixed", "sampling", False) in kinds, kinds


def test_prefix_cache_hits_and_preemption_recomputes_run_padded_as_plain(tiny) -> None:
    """Chunks that start after cached blocks, and prompts recomputed after a preemption, run
    as padded rows and give the plain path's tokens (4-token blocks, 8-token steps, a pool
    too small for every sequence)."""
    path, _, _, _ = tiny
    rng = random.Random(11)
    shared = [rng.randrange(3, 300) for _ in range(9)]
    prompts = [shared + [rng.randrange(3, 300) for _ in range(n)] for n in (2, 14, 5)]
    prompts.append([rng.randrange(3, 300) for _ in range(21)])
    hybrid = len(set(layer_types_of(path))) > 1
    options = {"block_size": 4, "max_num_batched_tokens": 8, "enable_prefix_caching": True,
               "num_kv_blocks": 24 if hybrid else 12}
    runs = {}
    for name in ("plain", "padded"):
        engine, calls = (padded_engine(path, "paged", **options) if name == "padded"
                         else (make_engine(path, "paged", **options), []))
        reqs = [Req(f"r{i}", p, greedy(16), 2 * i) for i, p in enumerate(prompts)]
        drive(engine, reqs)
        assert engine.scheduler.num_preemptions > 0 and engine.scheduler.allocator.prefix_hits
        runs[name] = [r.tokens for r in reqs]
    assert runs["padded"] == runs["plain"] and calls


def test_a_padded_step_computes_logits_of_its_sampled_rows_only(tiny) -> None:
    """Up to the step's token budget in token rows, but at most max_num_seqs rows of logits
    (one per sequence): prompt rows cost no lm_head, and the graphs' logits buffer stays that
    size."""
    path, prompts, new_tokens, refs = tiny
    engine, calls = padded_engine(path, "paged", max_num_seqs=2)
    padded = engine.runner.padded_decode
    assert padded.batch_buckets[-1] == 2 * MAX_MODEL_LEN and padded.max_sampled == 2
    with torch.no_grad():
        assert padded.forward(4, 1).shape[0] == 2
    reqs = [Req("r0", prompts[0], greedy(new_tokens[0]), 0),  # 1 token
            Req("r1", prompts[1][:3], greedy(9), 0)]  # 3 tokens: 4 rows, 2 sampled, padded
    drive(engine, reqs)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert [r.tokens for r in reqs] == [refs[0], hf_greedy(model, prompts[1][:3], 9)]
    assert calls[0] == (4, 1)


def test_a_step_of_prompt_chunks_alone_samples_nothing_and_runs_padded(tiny) -> None:
    path, prompts, new_tokens, refs = tiny
    engine, calls = padded_engine(path, "paged", max_num_batched_tokens=8)
    engine.add_request("long", prompts[3], greedy(new_tokens[3]))  # 33 tokens: 5 steps
    out = []
    for _ in range(4):  # chunks of 8: nothing sampled yet
        assert engine.step() == []
    assert calls == [(8, 1), (8, 1), (8, 2), (8, 2)]
    while engine.has_unfinished():
        out += [e.token_id for e in engine.step() if e.token_id is not None]
    assert out == refs[3]


def test_padding_rows_write_only_the_scratch_block_and_buffers_stay_put(tiny) -> None:
    path, _, _, _ = tiny
    engine, calls = padded_engine(path, "paged", max_num_seqs=8)
    for i in range(3):  # prompts: 9 rows, bucket 16; then decodes: 3 rows, bucket 4
        engine.add_request(f"r{i}", [5, 6, 7 + i], greedy(10))
    padded, runner = engine.runner.padded_decode, engine.runner
    pointers = {(padded.inputs.data_ptr(), padded.pages.data_ptr())}
    scratch = []
    for step in range(5):
        before = runner.kv_cache.clone()
        engine.step()
        seqs = engine.scheduler.running
        new = [range(3)] * 3 if step == 0 else [[s.num_computed_tokens - 1] for s in seqs]
        slots = [t[p // 16] * 16 + p % 16
                 for s, positions in zip(seqs, new, strict=True) for p in positions
                 for t in s.block_tables]
        changed = (runner.kv_cache != before).flatten(3).any(-1).any(0).any(0)  # [slots]
        written = set(changed.nonzero().flatten().tolist())
        assert written <= {*slots, runner.scratch_slot} and set(slots) <= written
        scratch.append(runner.scratch_slot in written)
        pointers.add((padded.inputs.data_ptr(), padded.pages.data_ptr()))
    # Padding rows write the same key and value each step: the slot changes the first time.
    assert scratch == [True, False, False, False, False], scratch
    assert len(pointers) == 1 and calls[0] == (9, 1) and calls[-1] == (3, 1)


def test_windowed_layers_read_only_the_pages_their_window_spans() -> None:
    """A 12-token window over pages of 16 spans 2 pages, whatever the context: the padded step
    gathers those (from each row's first visible page), and they show exactly the window."""
    caches = [torch.zeros(2, 5 * 16, 1, 1)]
    padded = PaddedDecode(None, caches, shared_layout((12,)), 64, 16, 4, 4)
    ctx = torch.tensor([40, 5, 1, 64])
    first = (ctx - 12).clamp(min=0)
    index, visible = padded._window_pages(ctx, first, 12, padded_width=4)
    assert index.shape == (4, 2) and visible.shape == (4, 1, 1, 32)
    for b in range(4):
        start = int(first[b]) // 16 * 16
        seen = [start + t for t in range(32) if visible[b, 0, 0, t]]
        assert seen == list(range(int(first[b]), int(ctx[b])))
    assert padded._window_pages(ctx, first, None, 4)[0] is None  # full layers: every page
    assert padded._window_pages(ctx, first, 40, 4)[0] is None  # the window spans them all


def test_buckets_cover_every_batch_and_width() -> None:
    assert batch_buckets(1) == [1] and batch_buckets(32) == [1, 2, 4, 8, 16, 32]
    assert batch_buckets(100) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100]
    assert width_buckets(128) == [1, 2, 4, 8, 16, 32, 64, 128] and width_buckets(6)[-1] == 6


def test_step_stats_say_which_steps_replayed_a_graph(tiny) -> None:
    """A step whose bucket has a graph reports graph=True (batchyard_graph_steps); a padded
    bucket without one, or a step past every bucket, ran eagerly. (CPU captures nothing: a
    stand-in graph replays the bucket's padded forward, as a captured one would.)"""
    path, prompts, _, _ = tiny
    engine, calls = padded_engine(path, "paged", max_num_batched_tokens=8)
    padded = engine.runner.padded_decode
    padded.graphs[(8, 1)] = lambda: padded.forward(8, 1)
    graphs = []
    engine.add_request("r", prompts[3][:12], greedy(3))  # 12 tokens: chunks of 8 and 4
    while engine.has_unfinished():
        engine.step()
        graphs.append(engine.last_step_stats(0.001).graph)
    assert calls[:2] == [(8, 1), (4, 1)] and graphs[:2] == [True, False]
    assert not any(graphs[2:])  # decodes of one row: bucket (1, 1), no graph
    engine.runner.use_padded_decode(None)  # eager from now on
    engine.add_request("s", prompts[1], greedy(2))
    engine.step()
    assert not engine.last_step_stats(0.001).graph


def test_graphs_cover_every_step_the_token_budget_allows_up_to_512_rows() -> None:
    """With requests waiting, a full batch's step carries as many prompt tokens as the budget
    allows (a 96-row cap ran 6-7 % of served steps eagerly at 40 clients); 512 rows at most,
    never below one decode row per sequence."""
    assert graph_rows(32, 512) == 512 and graph_rows(2, 512) == 512 and graph_rows(2, 66) == 66
    assert graph_rows(128, 8192) == 512 and graph_rows(1024, 8192) == 1024
    assert graph_rows(32, 40) == 40 and graph_rows(32, 16) == 32
    buckets = batch_buckets(512)
    assert buckets[:12] == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128]
    assert buckets[12:] == [160, 192, 224, 256, 320, 384, 448, 512]
    assert all(b / a <= 1.25 for a, b in zip(buckets[11:-1], buckets[12:], strict=True))


def test_the_start_up_check_compares_padded_with_eager_and_leaves_the_pool_empty(tiny) -> None:
    path, _, _, _ = tiny
    engine = make_engine(path, "paged")
    runner = engine.runner
    assert not prepare_decode_graphs(runner, False, 8, MAX_MODEL_LEN)  # CPU: no graphs
    assert runner.padded_decode is None
    calls = recorded(padded_in_use(runner, 8, MAX_MODEL_LEN))
    assert check_padded_decode(runner) < 1e-3
    assert not runner.kv_cache.any()
    windowed = any(w is not None for w in runner.layout.group_windows)  # one row past it
    assert [rows for rows, _ in calls] == [3 + windowed + 3]  # 3 decodes (+1), a 3-token chunk
    calls = recorded(padded_in_use(runner, 4, MAX_MODEL_LEN, max_num_seqs=2))
    check_padded_decode(runner)
    assert [rows for rows, _ in calls] == [4]  # a decode row and the chunk: the chunk goes first
    padded = padded_in_use(runner, 8, MAX_MODEL_LEN)
    broken = padded.forward
    padded.forward = lambda b, w: broken(b, w) + 1.0  # a graph that disagrees
    with pytest.raises(AssertionError, match="padded decode differs from eager"):
        check_padded_decode(runner)


def test_graphs_that_run_out_of_memory_are_captured_again_for_half_the_rows(
        tiny, monkeypatch, caplog) -> None:
    """Where the graphs of steps up to N rows run out of GPU memory, N / 2 are tried, down to
    the decode batch (under tensor parallelism not at all), each checked against eager; past
    that the error turns graphs off."""
    path, _, _, _ = tiny
    runner = make_engine(path, "paged").runner
    tried = []

    def capture(padded, vocab_size, limit):
        tried.append(padded.batch_buckets[-1])
        if padded.batch_buckets[-1] > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")
        return len(padded.all_buckets())

    monkeypatch.setattr(graphs_setup, "capture_cuda_graphs",
                        lambda padded, vocab: capture(padded, vocab, 16))
    with caplog.at_level(logging.WARNING, logger="engine.runner.graphs.setup"):
        padded, count, error = capture_within_memory(runner, 64, MAX_MODEL_LEN, True, 4)
    assert tried == [64, 32, 16] and padded.batch_buckets[-1] == 16
    assert runner.padded_decode is padded and count == len(padded.all_buckets()) and error < 1e-3
    assert "steps up to 64 tokens ran out of GPU memory (CUDA out of memory. Tried to allocate " \
           "2.00 GiB); trying 32" in caplog.text and not runner.kv_cache.any()
    tried.clear()
    monkeypatch.setattr(graphs_setup, "capture_cuda_graphs",
                        lambda padded, vocab: capture(padded, vocab, 0))
    with pytest.raises(torch.OutOfMemoryError):
        capture_within_memory(runner, 64, MAX_MODEL_LEN, True, 4)
    assert tried == [64, 32, 16, 8, 4] and runner.padded_decode is None
    tried.clear()  # tensor parallelism: every rank pads alike, so no rank shrinks on its own
    with pytest.raises(torch.OutOfMemoryError):
        capture_within_memory(runner, 64, MAX_MODEL_LEN, True, 4, floor=64)
    assert tried == [64] and runner.padded_decode is None


def test_the_start_up_check_catches_chunk_rows_that_miss_each_other(tiny, monkeypatch) -> None:
    path, _, _, _ = tiny
    runner = make_engine(path, "paged").runner
    padded_in_use(runner, 8, MAX_MODEL_LEN)

    def blind(plan):  # each chunk token sees up to the position before its own
        rows = token_rows(plan)
        chunk = {row + j for row, n, _, _ in plan.prefills for j in range(n)}
        return [(row, tables, ctx - (row in chunk)) for row, tables, ctx in rows]
    monkeypatch.setattr(model_runner, "token_rows", blind)
    with pytest.raises(AssertionError, match="padded decode differs from eager"):
        check_padded_decode(runner)
    monkeypatch.undo()
    padded = runner.padded_decode
    stage = padded.stage

    def unwritten(tokens, *rest):  # the chunk's first two tokens write only the scratch slot
        tokens = tokens.clone()
        tokens[2:, -3:-1] = runner.scratch_slot  # (the chunk is the step's last 3 rows)
        stage(tokens, *rest)
    padded.stage = unwritten
    # caught only because the pool is refilled between the eager and the padded pass
    with pytest.raises(AssertionError, match="padded decode differs from eager"):
        check_padded_decode(runner)


def test_the_padded_forward_traces_as_one_graph(tiny) -> None:
    """What torch.cuda.graph captures: no host sync, no graph break (GPU path: aten linears)."""
    path, _, _, _ = tiny
    engine = make_engine(path, "paged", linear_backend="aten")
    engine.runner.model.use_fused_cpu_ops(None)
    padded = padded_in_use(engine.runner, 8, MAX_MODEL_LEN)
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(padded.forward)(8, 4)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]


class HostBorn(TorchDispatchMode):
    """Records the tensors born from host data (torch.tensor, as_tensor of a Python value):
    on CUDA each is a pageable host-to-device copy, which graph capture refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.births: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in ("aten::lift_fresh", "aten::lift_fresh_copy"):
            self.births.append(str(args[0].shape))
        return func(*args, **(kwargs or {}))


def test_the_padded_forward_builds_no_tensor_from_host_data(tiny) -> None:
    """Found on an H200: Gemma scaled its embeddings by a torch.tensor(...) made per step, and
    capture refused every graph (decode then ran eagerly). Dynamo traces such a constant
    happily, so the trace test above cannot see it; the dispatcher can."""
    path, _, _, _ = tiny
    engine = make_engine(path, "paged", linear_backend="aten")
    engine.runner.model.use_fused_cpu_ops(None)
    padded = padded_in_use(engine.runner, 8, MAX_MODEL_LEN)
    host_born = HostBorn()
    with torch.no_grad(), host_born:
        padded.forward(8, 4)
    assert host_born.births == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("batching", STRATEGIES)
def test_cuda_graphs_are_captured_checked_and_exact(tiny, batching) -> None:
    path, prompts, new_tokens, _ = tiny
    eager = requests(prompts, new_tokens)
    drive(make_engine(path, batching, device="cuda", enforce_eager=True), eager)
    engine = make_engine(path, batching, device="cuda")
    graphs = engine.runner.padded_decode.graphs
    assert graphs, "no CUDA graph was captured"
    replayed = []
    for bucket, replay in list(graphs.items()):
        graphs[bucket] = lambda r=replay, b=bucket: replayed.append(b) or r()
    reqs = requests(prompts, new_tokens)
    drive(engine, reqs)
    assert [r.tokens for r in reqs] == [r.tokens for r in eager] and replayed
