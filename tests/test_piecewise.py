"""Piecewise steps on CPU: steps the whole-step graphs leave out (past their gather bound) run
padded to a row bucket over static inputs, cut at each attention call, with attention eager on
the real rows (engine/runner/graphs/piecewise.py). Here the pieces run eagerly and are compared with
transformers and the plain path; the capture's bookkeeping runs against a stand-in for
torch.cuda's graph API; on a GPU the pieces are captured and compared with eager steps."""

from __future__ import annotations

import contextlib
import json
import random

import pytest
import torch

from engine.runner.graphs import whole_step
from engine.runner.graphs.check import check_piecewise
from engine.runner.graphs.piecewise import PiecewiseStep
from tests import test_padded_decode
from tests.engine_harness import (
    MAX_MODEL_LEN,
    Req,
    drive,
    greedy,
    make_engine,
    padded_in_use,
    piecewise_in_use,
)
from tests.test_padded_decode import STRATEGIES, padded_engine, requests, sampled_tokens

tiny = test_padded_decode.tiny  # the same models and references (llama, mistral, gemma3)


def piecewise_engine(path, batching: str, rows: int = 64, **overrides):
    """An engine whose steps of up to `rows` tokens all run piecewise (no whole-step graphs)."""
    engine = make_engine(path, batching, **overrides)
    return engine, piecewise_in_use(engine.runner, rows, engine.config.max_num_seqs)


@pytest.mark.parametrize("batching", STRATEGIES)
def test_piecewise_steps_equal_transformers_in_every_strategy(tiny, batching) -> None:
    path, prompts, new_tokens, refs = tiny
    engine, piecewise = piecewise_engine(path, batching)
    runner, prompt_steps = engine.runner, []
    execute = runner.execute
    runner.execute = lambda plan, sampling: prompt_steps.append(bool(plan.prefills)) or execute(
        plan, sampling)
    reqs = requests(prompts, new_tokens)
    drive(engine, reqs)
    assert [r.tokens for r in reqs] == refs
    assert piecewise.steps == len(prompt_steps) and any(prompt_steps)


@pytest.mark.parametrize("batching", ["continuous", "paged"])
def test_piecewise_steps_equal_the_plain_path_for_sampled_rows(tiny, batching) -> None:
    path, prompts, new_tokens, _ = tiny
    plain = sampled_tokens(make_engine(path, batching), prompts, new_tokens)
    engine, piecewise = piecewise_engine(path, batching)
    assert sampled_tokens(engine, prompts, new_tokens) == plain and piecewise.steps


def test_steps_past_the_gather_bound_run_piecewise_beside_whole_step_graphs(tiny) -> None:
    """With whole-step graphs bounded at 64 gathered tokens, decode steps take them and steps
    with prompts (rows x context past 64) run piecewise; none of these 16-token steps runs
    eagerly."""
    path, prompts, new_tokens, refs = tiny
    engine, calls = padded_engine(path, "paged", max_num_batched_tokens=16)
    padded = engine.runner.padded_decode
    padded.gather_limit = 64 * padded.token_bytes
    piecewise = piecewise_in_use(engine.runner, 16, engine.config.max_num_seqs)
    runner, paths = engine.runner, []
    execute = runner.execute

    def spy(plan, sampling):
        padded, pieced = runner.padded_decode.steps, piecewise.steps
        rows = execute(plan, sampling)
        paths.append(("padded" if runner.padded_decode.steps > padded else
                      "piecewise" if piecewise.steps > pieced else "eager", bool(plan.prefills)))
        return rows
    runner.execute = spy
    reqs = requests(prompts, new_tokens)
    drive(engine, reqs)
    assert [r.tokens for r in reqs] == refs
    assert ("piecewise", True) in paths and ("padded", False) in paths
    assert all(path != "eager" for path, _ in paths)  # 16-token steps: every one fits a bucket


def test_prefix_cache_hits_and_preemption_recomputes_run_piecewise_as_plain(tiny) -> None:
    """Chunks that start after cached blocks (their attention reads the cached prefix), and
    prompts recomputed after a preemption, run piecewise with the plain path's tokens."""
    path, _, _, _ = tiny
    rng = random.Random(11)
    shared = [rng.randrange(3, 300) for _ in range(9)]
    prompts = [shared + [rng.randrange(3, 300) for _ in range(n)] for n in (2, 14, 5)]
    prompts.append([rng.randrange(3, 300) for _ in range(21)])
    hybrid = len(set(test_padded_decode.layer_types_of(path))) > 1
    options = {"block_size": 4, "max_num_batched_tokens": 8, "enable_prefix_caching": True,
               "num_kv_blocks": 24 if hybrid else 12}
    runs = {}
    for name in ("plain", "piecewise"):
        engine = make_engine(path, "paged", **options)
        if name == "piecewise":
            piecewise = piecewise_in_use(engine.runner, 8, engine.config.max_num_seqs)
        reqs = [Req(f"r{i}", p, greedy(16), 2 * i) for i, p in enumerate(prompts)]
        drive(engine, reqs)
        assert engine.scheduler.num_preemptions > 0 and engine.scheduler.allocator.prefix_hits
        runs[name] = [r.tokens for r in reqs]
    assert runs["piecewise"] == runs["plain"] and piecewise.steps


def test_padding_rows_write_only_the_scratch_block_and_inputs_stay_put(tiny) -> None:
    path, _, _, _ = tiny
    engine, piecewise = piecewise_engine(path, "paged", max_num_seqs=8)
    for i in range(3):  # prompts: 9 rows, bucket 16; then decodes: 3 rows, bucket 4
        engine.add_request(f"r{i}", [5, 6, 7 + i], greedy(10))
    runner = engine.runner
    pointers = {(piecewise.inputs.data_ptr(), piecewise.sample_index.data_ptr())}
    for step in range(4):
        before = runner.kv_cache.clone()
        engine.step()
        seqs = engine.scheduler.running
        new = [range(3)] * 3 if step == 0 else [[s.num_computed_tokens - 1] for s in seqs]
        slots = {t[p // 16] * 16 + p % 16
                 for s, positions in zip(seqs, new, strict=True) for p in positions
                 for t in s.block_tables}
        changed = (runner.kv_cache != before).flatten(3).any(-1).any(0).any(0)  # [slots]
        written = set(changed.nonzero().flatten().tolist())
        assert written <= {*slots, runner.scratch_slot} and slots <= written
        pointers.add((piecewise.inputs.data_ptr(), piecewise.sample_index.data_ptr()))
    assert len(pointers) == 1 and piecewise.steps == 4


def test_the_start_up_check_compares_piecewise_with_eager_and_catches_a_wrong_cut(
        tiny, monkeypatch) -> None:
    path, _, _, _ = tiny
    engine, _ = piecewise_engine(path, "paged")
    runner = engine.runner
    assert check_piecewise(runner) < 1e-4
    assert not runner.kv_cache.any()  # the check leaves the pool empty
    attend = PiecewiseStep.attend
    # a cut that hands the next piece its own rows' attention, but one row late
    monkeypatch.setattr(PiecewiseStep, "attend", lambda self, *args: attend(self, *args).roll(1, 0))
    with pytest.raises(AssertionError, match="piecewise steps differ from eager"):
        check_piecewise(runner)


def test_padded_decode_on_cpu_runs_piecewise_too_unless_experts_or_eager(tmp_path) -> None:
    from tests.models_fixtures import build_tiny_model

    dense = build_tiny_model(tmp_path / "llama")
    assert make_engine(dense, "paged", padded_decode_on_cpu=True).runner.piecewise is not None
    assert make_engine(dense, "paged").runner.piecewise is None
    assert make_engine(dense, "paged", padded_decode_on_cpu=True,
                       enforce_eager=True).runner.piecewise is None
    full = make_engine(dense, "paged", padded_decode_on_cpu=True, cudagraph_mode="full").runner
    assert full.padded_decode is not None and full.piecewise is None  # whole-step graphs alone
    assert full.padded_decode.gather_limit >= whole_step.MAX_PADDED_GATHER_BYTES
    none = make_engine(dense, "paged", padded_decode_on_cpu=True, cudagraph_mode="none").runner
    assert none.padded_decode is None and none.piecewise is None
    experts = build_tiny_model(tmp_path / "moe", arch="mixtral")
    # an expert model's prompt rows are not padded (routing reads the host): no pieces either
    assert make_engine(experts, "paged", padded_decode_on_cpu=True).runner.piecewise is None


def kv_bytes_per_token(path, element_size: int) -> int:
    """A token's K and V in one layer of the model at `path`."""
    config = json.loads((path / "config.json").read_text())
    config = config.get("text_config", config)
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config.get("num_key_value_heads", heads) * head_dim * element_size


def test_whole_step_graphs_are_bounded_by_the_bytes_they_gather(tiny) -> None:
    """The largest whole-step bucket gathers at most MAX_PADDED_GATHER_BYTES of K and V per
    layer: a model with 8x the KV bytes per token gets an eighth of the tokens."""
    path, _, _, _ = tiny
    engine, _ = padded_engine(path, "paged", max_model_len=MAX_MODEL_LEN)
    padded = engine.runner.padded_decode
    assert padded.token_bytes == kv_bytes_per_token(path, element_size=4)
    limit = whole_step.MAX_PADDED_GATHER_BYTES
    assert padded.gather_limit == limit
    for rows, width in padded.all_buckets():
        assert rows * width * padded.page_size * padded.token_bytes <= limit
    widest = padded.width_buckets[-1]
    # as if each token's K and V were so large that two rows of the widest context fill it
    padded.token_bytes = limit // (2 * widest * padded.page_size)
    assert padded.fits(2, widest) and not padded.fits(3, widest)  # bucket 4: 2x the bytes
    assert padded.fits(4, 2) and not padded.fits(4, widest)  # fewer pages, more rows
    # without pieces to take the rest (tensor parallelism, expert models), the old 2^17 tokens
    alone = padded_in_use(engine.runner, 16, MAX_MODEL_LEN, pieces_follow=False)
    assert alone.gather_limit == max(limit, whole_step.MAX_PADDED_TOKENS_ALONE
                                     * alone.token_bytes)


class FakeGraph:
    """torch.cuda.CUDAGraph's capture API on CPU: the forward runs for real while 'captured';
    a replay only logs itself (what the bookkeeping is checked by)."""

    log: list = []

    def __init__(self) -> None:
        self.capturing = False

    def capture_begin(self, pool=None) -> None:
        assert not any(g.capturing for g in FakeGraph.live), "two captures at once"
        self.capturing, self.pool_in = True, pool
        FakeGraph.live.append(self)

    def capture_end(self) -> None:
        assert self.capturing
        self.capturing = False

    def pool(self) -> str:
        return self.pool_in if self.pool_in is not None else f"pool of {id(self)}"

    def replay(self) -> None:
        FakeGraph.log.append(self)


@pytest.fixture
def fake_cuda_graphs(monkeypatch):
    FakeGraph.live, FakeGraph.log = [], []
    stream = type("Stream", (), {"wait_stream": lambda self, other: None})
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "Stream", stream)
    monkeypatch.setattr(torch.cuda, "current_stream", stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    return FakeGraph


def test_a_capture_cuts_one_graph_per_attention_call_and_replays_them_in_turn(
        tiny, fake_cuda_graphs) -> None:
    """Per bucket: one graph more than the model has layers, in one pool; every call shares
    the same static q and out buffers; a replay runs graph, attention, graph, ... in order,
    each attention on the real rows with its layer's group."""
    path, _, _, _ = tiny
    engine, piecewise = piecewise_engine(path, "paged", rows=16)
    layers = len(engine.runner.layer_caches)
    count = piecewise.capture(engine.runner.spec.vocab_size, [4, 16])  # the buckets asked for
    assert sorted(piecewise.graphs) == [4, 16] and count == 2 * (layers + 1)
    assert len({g.pool() for g in fake_cuda_graphs.live}) == 1  # one pool for them all
    layout = engine.runner.layout
    for bucket, pieces in piecewise.graphs.items():
        assert len(pieces.graphs) == layers + 1 and len(pieces.calls) == layers
        assert [c.group for c in pieces.calls] == list(layout.layer_groups or [0] * layers)
        assert {(c.q.data_ptr(), c.out.data_ptr()) for c in pieces.calls} == {
            (b[0].data_ptr(), b[1].data_ptr()) for b in piecewise._buffers.values()}
        assert all(len(c.q) == bucket for c in pieces.calls)
    attended = []
    pieces = piecewise.graphs[4]
    group_backend = type("Attend", (), {"forward": lambda self, q, k, v, meta, scale:
                                        attended.append((len(fake_cuda_graphs.log), len(q)))
                                        or torch.zeros_like(q)})()
    meta = type("Meta", (), {"groups": None, "backend": group_backend})()
    (_, out), = piecewise._buffers.values()
    with torch.inference_mode():
        out.fill_(7.0)  # what an earlier step's rows left there
        piecewise.run(torch.zeros(2 + layout.num_tables, 3, dtype=torch.long), meta,
                      torch.tensor([2]))
    assert piecewise.replayed and fake_cuda_graphs.log == list(pieces.graphs)
    assert attended == [(i + 1, 3) for i in range(layers)]  # after piece i, 3 real rows
    assert not out[3:].any()  # padding rows' attention is zero, as in the eager pieces
    fake_cuda_graphs.log.clear()
    with torch.inference_mode():  # 7 rows: bucket 8, not captured, runs its pieces eagerly
        piecewise.run(torch.zeros(2 + layout.num_tables, 7, dtype=torch.long), meta,
                      torch.tensor([6]))
    assert not piecewise.replayed and not fake_cuda_graphs.log


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("batching", ["continuous", "paged"])
def test_piecewise_cuda_graphs_are_captured_checked_and_exact(tiny, batching,
                                                             monkeypatch) -> None:
    """Whole-step graphs bounded at 64 gathered tokens: the steps with prompts replay pieces,
    and every token equals the eager engine's."""
    path, prompts, new_tokens, _ = tiny
    eager = requests(prompts, new_tokens)
    drive(make_engine(path, batching, device="cuda", enforce_eager=True), eager)
    monkeypatch.setattr(whole_step, "MAX_PADDED_GATHER_BYTES",
                        64 * kv_bytes_per_token(path, element_size=4))  # the tests' float32
    engine = make_engine(path, batching, device="cuda")
    piecewise = engine.runner.piecewise
    assert piecewise is not None and piecewise.graphs, "no piecewise graph was captured"
    replayed = []
    replay = piecewise._replay
    piecewise._replay = lambda *args: replayed.append(args[2]) or replay(*args)
    steps = piecewise.steps
    reqs = requests(prompts, new_tokens)
    drive(engine, reqs)
    assert [r.tokens for r in reqs] == [r.tokens for r in eager] and replayed
    assert piecewise.steps - steps == len(replayed)  # every piecewise step replayed its graphs
