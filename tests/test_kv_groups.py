"""KV groups (engine/kv/layout.py): models mixing full and windowed layers keep, in their
windowed layers, only the window's KV. Layouts, the multi-table block manager, and served
tokens equal to transformers generate in every configuration that uses them."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmark.cli import main as bench_main
from engine.config import EngineConfig
from engine.kv.block_manager import MAX_SEQ_TOKENS, BlockManager
from engine.kv.budget import build_allocator, plan_kv
from engine.kv.layout import MAX_TABLES, blocks_held, hybrid_layout, kv_layout, shared_layout
from engine.outputs import SampledToken
from engine.sampling_params import SamplingParams
from engine.scheduler import SCHEDULERS
from engine.sequence import FinishReason, Sequence
from tests.engine_harness import Req, drive, greedy, hf_greedy, make_engine
from tests.models_fixtures import build_tiny_model

S, F = 6, None  # a windowed layer (6 tokens) and a full one
GEMMA3_1B = tuple(F if i % 6 == 5 else 512 for i in range(26))  # one full layer in six


def test_layers_split_into_equal_groups_with_a_table_each() -> None:
    layout = hybrid_layout(GEMMA3_1B)
    assert layout.num_tensors == 4  # the fewest layers of a kind (4 full ones)
    assert layout.group_windows == (512,) * 6 + (F,) and layout.num_tables == 7
    assert layout.table_windows == (512,) * 6 + (F,)
    for group in range(7):  # each group's layers in distinct tensors, its window's layers
        layers = [i for i, g in enumerate(layout.layer_groups) if g == group]
        assert [layout.layer_tensors[i] for i in layers] == list(range(len(layers)))
        assert {GEMMA3_1B[i] for i in layers} == {layout.group_windows[group]}
    assert [layout.layer_groups.count(g) for g in range(7)] == [4, 4, 4, 4, 4, 2, 4]


def test_one_odd_layer_does_not_make_a_table_per_layer() -> None:
    windows = (F,) + (S,) * 25
    layout = hybrid_layout(windows)
    assert layout.num_tables <= MAX_TABLES and layout.num_tensors == 4


def test_shared_layout_where_a_table_must_hold_every_layer() -> None:
    mixed = (S, F, S, F)
    assert kv_layout(mixed, True, 64, 4).num_tables == 2
    layout = kv_layout(mixed, False, 64, 4)  # contiguous: a max_model_len region per sequence
    assert layout.num_tables == 1 and layout.num_tensors == 4
    assert layout.table_windows == (None,) and layout.group_windows == (S, F)
    assert kv_layout((S, S), True, 64, 4) == shared_layout((S, S))
    assert shared_layout((S, S)).table_windows == (S,)
    # one windowed layer among 27 full ones: 8 groups of 4 (the windowed one padded to 4) would
    # hold more than one table of 28 layers
    assert kv_layout((F,) * 27 + (4096,), True, 32768, 16).num_tables == 1


def test_blocks_held_by_a_sequence() -> None:
    # blocks of 4, window 6: at most ceil(5 / 4) + 1 = 3 blocks in the windowed table
    assert blocks_held((F, S), 40, 4) == 10 + 3
    assert blocks_held((F, S), 8, 4) == 2 + 2
    assert blocks_held((S,), 10_000, 4) == 3


def make_seq(seq_id: int, tokens: int, max_new: int = 4, same: bool = False) -> Sequence:
    """`tokens` tokens of its own (of every such sequence's, when `same`)."""
    return Sequence(seq_id, [100 + (0 if same else seq_id)] * tokens,
                    SamplingParams(max_new_tokens=max_new, ignore_eos=True))


def test_every_table_grows_together_and_the_windowed_one_slides() -> None:
    pool = BlockManager(num_blocks=20, block_size=4, table_windows=(F, S))
    seq = make_seq(0, 17)
    assert pool.free_slots(seq) == 10 * 4  # a block position costs a block in each table
    assert pool.can_allocate(seq, 17) and not pool.can_allocate(make_seq(1, 41), 41)
    pool.allocate(seq, 17)
    assert [len(t) for t in seq.block_tables] == [5, 5] and pool.num_free_blocks == 10
    seq.num_computed_tokens = 17  # the next query (position 17) sees 12..17: blocks 3 and 4
    pool.release_outside_window(seq)
    assert seq.block_tables[1][:3] == [pool.outside_window] * 3 and pool.num_free_blocks == 13
    assert seq.block_tables[0].count(pool.outside_window) == 0
    pool.check_integrity([seq])
    pool.free(seq)
    assert seq.block_tables == [[]] and pool.num_free_blocks == 20
    pool.check_integrity([seq])


def test_a_cached_prompt_is_shared_in_every_table_and_a_window_needs_only_its_blocks() -> None:
    pool = BlockManager(40, 4, enable_prefix_caching=True, table_windows=(F, S))
    out = pool.outside_window
    first = make_seq(0, 21, same=True)  # 5 full blocks and a token
    pool.allocate(first, 21)
    first.num_computed_tokens = 21
    pool.cache_full_blocks(first)  # cached before the window lets them go
    pool.release_outside_window(first)  # position 21 sees 16..21: blocks 4 and 5
    assert first.block_tables[1][:4] == [out] * 4
    pool.check_integrity([first])
    second = make_seq(1, 21, same=True)
    assert pool.match_prefix(second) == 20  # 5 blocks; position 20 sees blocks 3 and 4
    assert second.block_tables[0] == first.block_tables[0][:5]
    windowed = second.block_tables[1]
    assert windowed[:3] == [out] * 3 and windowed[4] == first.block_tables[1][4]
    assert windowed[3] != out  # slid past in `first`, still cached: shared again
    pool.check_integrity([first, second])
    longer = make_seq(2, 29, same=True)  # block 5 was never full: the same 5 match
    assert pool.match_prefix(longer) == 20 and pool.prefix_hits == 10
    for seq in (first, second, longer):
        pool.free(seq)
    pool.check_integrity([])
    assert pool.num_free_blocks == 40
    assert pool.match_prefix(make_seq(3, 9, same=True)) == 8  # blocks 0 and 1, both tables
    assert pool._cached_prompt(make_seq(9, 400))[1] == []  # a full table's miss ends the walk
    other = BlockManager(40, 4, enable_prefix_caching=True, table_windows=(F, S))
    late = make_seq(4, 21, same=True)
    other.allocate(late, 21)
    late.num_computed_tokens = 21
    other.release_outside_window(late)  # slid out before it was cached: gone for good
    other.cache_full_blocks(late)
    assert other.match_prefix(make_seq(5, 21, same=True)) == 0  # block 3 of the window is gone


def test_the_longest_sequence_depends_on_chunking() -> None:
    whole = BlockManager(20, 4, table_windows=(F, S))
    chunked = BlockManager(20, 4, table_windows=(F, S), whole_prompts=False)
    assert whole.max_seq_tokens == 40  # a whole prompt: every table holds it at once
    assert chunked.max_seq_tokens == 68  # 17 full blocks + the window's 3
    assert BlockManager(20, 4, table_windows=(S,), whole_prompts=False).max_seq_tokens \
        == MAX_SEQ_TOKENS  # a window only: no length fills the pool


def test_the_pool_plan_counts_block_ids_of_a_group_of_layers() -> None:
    layout = hybrid_layout((S, F, S, F, S, F))  # 2 tables of 3 layers
    config = EngineConfig(model="unused", batching="paged", block_size=4, max_num_seqs=2,
                          kv_cache_memory=2**20, enable_chunked_prefill=True)
    plan = plan_kv(config, 64, bytes_per_token=3 * 256, default_budget_bytes=0, layout=layout)
    assert plan.num_blocks == 2 * 64 * 2 // 4  # capped at 2 sequences in every table
    assert plan.max_concurrency == plan.num_blocks // (16 + 3)  # full table + window's blocks
    pool = build_allocator(config, plan)
    assert isinstance(pool, BlockManager) and pool.table_windows == (S, F)


def test_a_pool_with_fewer_blocks_than_tables_is_refused_at_start_up() -> None:
    config = EngineConfig(model="unused", batching="paged", block_size=4, num_kv_blocks=6)
    with pytest.raises(ValueError, match="6 blocks, fewer than the 7 block tables"):
        plan_kv(config, 64, 256, 0, hybrid_layout(GEMMA3_1B))


@pytest.mark.parametrize("chunked", [False, True])
def test_random_workload_over_two_tables_drains_clean(chunked: bool) -> None:
    """Random prompts, aborts and a tight pool of windowed + full tables: preemptions happen,
    integrity holds every step and every block comes back."""
    rng = random.Random(3)
    config = EngineConfig(model="unused", batching="paged", max_num_seqs=6, block_size=4,
                          max_num_batched_tokens=rng.choice([5, 9]) if chunked else 64,
                          enable_chunked_prefill=chunked)
    pool = BlockManager(40, 4, table_windows=(S, F, S), whole_prompts=not chunked)
    sched = SCHEDULERS["paged"](config, pool)
    seqs: list[Sequence] = []
    for step_no in range(3000):
        if step_no < 200 and rng.random() < 0.3:
            seq = make_seq(len(seqs), rng.randint(1, 30), max_new=rng.randint(1, 20))
            seqs.append(seq)
            sched.add(seq)
        if seqs and rng.random() < 0.03:
            sched.finish(rng.choice(seqs), FinishReason.ABORT)
        batch = sched.schedule()
        sched.check_integrity()
        if batch is not None:
            sched.postprocess(batch, [SampledToken(7, 0.0) if batch.is_sampled(i) else None
                                      for i in range(len(batch.seqs))])
            sched.check_integrity()
            for seq in batch.seqs:  # a windowed table holds its window's blocks at most
                held = [b for b in seq.block_tables[-1] if b != pool.outside_window]
                assert seq.is_finished or len(held) <= blocks_held((S,), 10**6, 4)
        if step_no > 200 and not sched.has_unfinished():
            break
    assert not sched.has_unfinished() and sched.num_preemptions > 0
    assert pool.num_free_blocks == 40 and all(not s.block_tables[0] for s in seqs)


# Gemma 3 shaped: 7 layers, 2 full, 5 windowed -> groups of 2 layers: windowed (0, 1), (3, 4),
# (5,) and full (2, 6); 4 block tables over 2 pool tensors (the short group's second is idle).
KINDS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
         "sliding_attention", "sliding_attention", "full_attention"]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("groups"), arch="gemma3",
                            num_hidden_layers=7, layer_types=KINDS)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (23, 5, 31, 12)]
    new_tokens = [40, 30, 25, 44]
    refs = [hf_greedy(model, p, n) for p, n in zip(prompts, new_tokens, strict=True)]
    return path, prompts, new_tokens, refs


CASES = {
    "chunks": {"max_num_batched_tokens": 8},
    "prefix-cache": {"enable_prefix_caching": True, "max_num_batched_tokens": 8},
    "whole-prompts": {"enable_chunked_prefill": False},
    "preemption": {"block_size": 4, "num_kv_blocks": 60, "max_num_batched_tokens": 8},
    "padded-decode": {"padded_decode_on_cpu": True},
    "async": {"async_scheduling": True, "max_num_batched_tokens": 8},
    "fallback": {"model_impl": "transformers", "max_num_batched_tokens": 8},
}


@pytest.mark.parametrize("case", list(CASES))
def test_grouped_kv_serves_transformers_tokens(gemma3, case) -> None:
    path, prompts, new_tokens, refs = gemma3
    engine = make_engine(path, "paged", **{"block_size": 4, **CASES[case]})
    layout = engine.runner.layout
    assert (layout.num_tables, layout.num_tensors) == (4, 2)
    assert engine.runner.kv_cache.shape[0] == 2
    reqs = [Req(f"r{i}", p, greedy(n), 2 * i)
            for i, (p, n) in enumerate(zip(prompts, new_tokens, strict=True))]
    drive(engine, reqs)
    assert [r.tokens for r in reqs] == refs
    if case == "preemption":
        assert engine.scheduler.num_preemptions > 0
    if case == "padded-decode":
        assert engine.runner.padded_decode.steps > 0


def test_windowed_tables_keep_only_the_window(gemma3) -> None:
    """Long sequences: the windowed tables hold the window's blocks, the full ones everything;
    the same memory keeps more sequences than one table per layer would."""
    path, prompts, _, _ = gemma3
    engine = make_engine(path, "paged", block_size=4, max_num_batched_tokens=8)
    pool, held = engine.scheduler.allocator, []  # blocks in each windowed table, every step

    def look(stepped) -> None:
        for seq in stepped.scheduler.running:
            held.extend(len([b for b in t if b != pool.outside_window])
                        for t, w in zip(seq.block_tables, pool.table_windows, strict=True)
                        if w is not None)
            assert pool.outside_window not in seq.block_tables[pool.table_windows.index(None)]

    drive(engine, [Req(f"r{i}", p, greedy(50)) for i, p in enumerate(prompts)], after_step=look)
    assert 0 < max(held) <= blocks_held((6,), 10**6, 4)
    # 4 sequences of max_model_len with a tensor per layer (7 layers of 256 bytes a token)
    memory = {"kv_cache_memory": 4 * 96 * 7 * 256, "max_num_seqs": 16, "block_size": 4}
    plain = make_engine(path, "paged", kv_groups=False, **memory)
    assert plain.runner.layout.num_tables == 1 and plain.runner.kv_cache.shape[0] == 7
    grouped = make_engine(path, "paged", **memory)
    assert plain.max_concurrency == 4 and grouped.max_concurrency == 10  # 336 blocks // 33
    assert grouped.runner.kv_cache_bytes <= plain.runner.kv_cache_bytes * 1.01


def test_the_benchmark_compares_groups_with_one_table(gemma3, tmp_path) -> None:
    path, _, _, _ = gemma3
    assert bench_main(["kv-groups", str(path), "--requests", "4", "--batch", "4",
                       "--prompt-tokens", "10", "--new-tokens", "86", "--kv-memory-mib", "0.5",
                       "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "kv-groups.json").read_text())
    groups, one = report["groups"], report["one_table"]
    assert (groups["tables"], one["tables"]) == (4, 1)
    assert groups["max_concurrency"] > one["max_concurrency"] > 0
    assert groups["mean_batch"] > one["mean_batch"] and report["ratio"] > 0


def test_prefix_caching_with_kv_groups_serves_transformers_tokens(gemma3) -> None:
    """Prompts sharing a 26-token prefix (longer than the window) after the first has run: their
    prompts reuse its blocks in every table (a windowed table: those its window sees)."""
    path, prompts, _, _ = gemma3
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    shared = prompts[2][:26]
    asked = [shared + [7, 8, 9], shared + [40 + i for i in range(9)], shared[:13] + [5]]
    refs = [hf_greedy(model, p, 12) for p in asked]
    engine = make_engine(path, "paged", block_size=4, enable_prefix_caching=True)
    assert engine.runner.layout.num_tables == 4
    reqs = [Req(f"r{i}", p, greedy(12), 0 if i == 0 else 20) for i, p in enumerate(asked)]
    drive(engine, reqs)
    assert [r.tokens for r in reqs] == refs
    assert engine.scheduler.allocator.prefix_hits == 6 + 3  # every shared full block


def test_one_window_for_every_layer_frees_and_reuses_blocks_with_prefix_caching(tmp_path) -> None:
    """Mistral (a 12-token window on every layer), prefix caching on: sequences give back what
    they slide past, and later prompts with the same prefix still reuse the cached window."""
    path = build_tiny_model(tmp_path, arch="mistral")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    shared = list(range(10, 40))
    asked = [shared + [5], shared + [6, 7], shared[:20] + [8]]
    refs = [hf_greedy(model, p, 30) for p in asked]
    engine = make_engine(path, "paged", block_size=4, enable_prefix_caching=True)
    pool = engine.scheduler.allocator
    assert pool.table_windows == (12,)
    reqs = [Req(f"r{i}", p, greedy(30), 0 if i == 0 else 40) for i, p in enumerate(asked)]
    slid = []  # entries given back, per step
    drive(engine, reqs, after_step=lambda e: slid.append(sum(
        s.block_table.count(pool.outside_window) for s in e.scheduler.running)))
    assert [r.tokens for r in reqs] == refs
    assert sum(slid) > 0 and pool.prefix_hits == 7 + 5  # every shared full block
