"""Paged strategy correctness: chunk budgets, prefix caching and preemption never change the
greedy float32 tokens, and all four strategies agree."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import RequestError
from tests.engine_harness import (
    Req,
    drive,
    greedy,
    hf_greedy,
    make_engine,
    prompts_with_references,
    staggered_requests,
)
from tests.models_fixtures import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("paged"), arch="llama")
    new_tokens = [9, 14, 5, 12, 6, 10]
    prompts, refs = prompts_with_references(path, 3, 21, (0, 3, 11), (1, 30, 7), new_tokens)
    return path, prompts, new_tokens, refs


def requests(prompts, new_tokens) -> list[Req]:
    return staggered_requests(prompts, new_tokens, [0, 0, 1, 4, 4, 9])


@pytest.mark.parametrize("budget", [1, 2, 3, 16, 256])
@pytest.mark.parametrize("prefix", [False, True])
def test_chunk_budgets_and_prefix_cache_keep_greedy_output(tiny, budget, prefix) -> None:
    """Any chunk size, prefix caching on or off: the tokens equal transformers'."""
    path, prompts, new_tokens, refs = tiny
    reqs = requests(prompts, new_tokens)
    engine = make_engine(path, "paged", max_num_batched_tokens=budget, block_size=4,
                         enable_prefix_caching=prefix)
    drive(engine, reqs)
    assert [r.tokens for r in reqs] == refs
    if prefix:
        assert engine.scheduler.allocator.prefix_hits > 0


@pytest.mark.parametrize("block_size", [32, 12])
def test_blocks_of_several_pages_keep_greedy_output(tiny, block_size) -> None:
    """A block of 32 is gathered as 2 pages of 16; a block of 12 as one page of 12."""
    path, prompts, new_tokens, refs = tiny
    reqs = requests(prompts, new_tokens)
    engine = make_engine(path, "paged", max_num_batched_tokens=7, block_size=block_size,
                         enable_prefix_caching=True)
    drive(engine, reqs)
    assert [r.tokens for r in reqs] == refs


def test_unchunked_prefill_keeps_greedy_output(tiny) -> None:
    path, prompts, new_tokens, refs = tiny
    reqs = requests(prompts, new_tokens)
    drive(make_engine(path, "paged", max_num_batched_tokens=8, enable_chunked_prefill=False),
          reqs)
    assert [r.tokens for r in reqs] == refs


@pytest.mark.parametrize("prefix", [False, True])
def test_forced_preemption_keeps_greedy_output(tiny, prefix) -> None:
    """A pool of a few blocks and 12 long sequences: preemptions happen, output is unchanged."""
    path, prompts, _, _ = tiny
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    long_prompts = [prompts[i % 3] + [5 + i] * 8 for i in range(12)]
    reqs = [Req(f"p{i}", p, greedy(24)) for i, p in enumerate(long_prompts)]
    engine = make_engine(path, "paged", max_num_seqs=12, block_size=4, num_kv_blocks=24,
                         max_num_batched_tokens=32, enable_prefix_caching=prefix)
    drive(engine, reqs)
    assert engine.scheduler.num_preemptions > 0
    for r in reqs:
        assert r.tokens == hf_greedy(model, r.prompt, 24), r.request_id


def test_needle_alone_and_among_many_gives_identical_output(tiny) -> None:
    """One prompt run alone and among 40 random prompts produces the same tokens."""
    path, prompts, _, _ = tiny
    rng = random.Random(11)
    needle = Req("needle", prompts[4], greedy(16))
    drive(make_engine(path, "paged"), [needle])
    crowd = [Req(f"c{i}", [rng.randrange(3, 200) for _ in range(rng.randint(1, 40))],
                 greedy(rng.randint(1, 20)), rng.randint(0, 10)) for i in range(40)]
    again = Req("needle", prompts[4], greedy(16), 5)
    crowd.insert(rng.randint(0, 40), again)
    drive(make_engine(path, "paged", max_num_seqs=16, max_num_batched_tokens=64), crowd)
    assert again.tokens == needle.tokens


def test_all_four_strategies_agree(tiny) -> None:
    """none, dynamic, continuous and paged give identical greedy tokens on the same prompts."""
    path, prompts, new_tokens, _ = tiny
    outputs = {}
    for batching in ("none", "dynamic", "continuous", "paged"):
        reqs = requests(prompts, new_tokens)
        drive(make_engine(path, batching), reqs)
        outputs[batching] = [r.tokens for r in reqs]
    assert len({str(v) for v in outputs.values()}) == 1, outputs


def test_request_larger_than_the_pool_is_rejected(tiny) -> None:
    """A request that can never fit the KV pool is refused at admission, naming the limit."""
    path, prompts, _, _ = tiny
    engine = make_engine(path, "paged", block_size=4, num_kv_blocks=8)
    with pytest.raises(RequestError, match="whole KV pool"):
        engine.add_request("big", prompts[0], greedy(20))
    assert not engine.has_unfinished()


def test_a_sliding_window_frees_the_blocks_sequences_slide_past(tmp_path) -> None:
    """Mistral with a 12-token window, blocks of 4: three 70-token sequences run at once in a
    pool of 20 blocks (full contexts would need 54), never holding more than the window's blocks
    each, and their tokens equal transformers generate."""
    path = build_tiny_model(tmp_path, arch="mistral")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [[5 + i, 9, 40, 7, 11, 60, 3 + i, 8, 90, 14] for i in range(3)]
    refs = [hf_greedy(model, p, 60) for p in prompts]
    engine = make_engine(path, "paged", block_size=4, num_kv_blocks=20)
    reqs = [Req(f"r{i}", p, greedy(60)) for i, p in enumerate(prompts)]
    used = []  # blocks in use after each step
    drive(engine, reqs, after_step=lambda e: used.append(e.scheduler.allocator.num_used_blocks))
    assert [r.tokens for r in reqs] == refs
    assert engine.scheduler.num_preemptions == 0
    assert max(used) <= 3 * (12 // 4 + 2)  # the window's blocks, the one being written, one spare
    assert engine.scheduler.allocator.num_free_blocks == 20


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failed_step_leaves_no_kv_for_a_later_prompt_to_reuse(tiny, async_scheduling,
                                                                 caplog) -> None:
    """The device fails when a prefill's tokens are read, after its blocks were published to the
    prefix cache: the cache is emptied, so the same prompt later is computed afresh (no hit on
    blocks whose KV may be garbage) and still gives transformers' tokens. A healthy start-up
    (whose async check also ends with fail_last_batch) empties nothing."""
    path, prompts, new_tokens, refs = tiny
    i = max(range(len(prompts)), key=lambda k: len(prompts[k]))
    engine = make_engine(path, "paged", block_size=4, enable_prefix_caching=True,
                         async_scheduling=async_scheduling)
    assert engine.async_scheduling == async_scheduling
    assert "prefix cache emptied" not in caplog.text
    launch = engine.runner.launch

    def failing_read(batch):
        result = launch(batch)
        result.tokens = lambda: (_ for _ in ()).throw(RuntimeError("device lost"))
        return result
    engine.runner.launch = failing_read
    engine.add_request("a", prompts[i], greedy(new_tokens[i]))
    outputs = []
    while engine.has_unfinished():
        try:
            outputs += engine.step_outputs()
        except RuntimeError:
            outputs += engine.fail_last_batch("engine failure")
    assert [o.finish_reason for o in outputs] == ["error"]
    assert "prefix cache emptied" in caplog.text
    engine.scheduler.check_integrity()
    engine.runner.launch = launch
    again = Req("b", prompts[i], greedy(new_tokens[i]))
    hits = engine.scheduler.allocator.prefix_hits  # the start-up check's prompts may have hit
    drive(engine, [again])
    assert engine.scheduler.allocator.prefix_hits == hits
    assert again.tokens == refs[i]
