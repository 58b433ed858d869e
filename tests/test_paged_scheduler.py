"""Block manager and paged scheduler units: no torch, integrity after every call."""

from __future__ import annotations

import random

import pytest

from engine.config import EngineConfig
from engine.kv.block_manager import BlockManager
from engine.outputs import SampledToken
from engine.sampling_params import SamplingParams
from engine.scheduler import SCHEDULERS
from engine.scheduler.paged import PagedBatching
from engine.sequence import FinishReason, Sequence, SequenceStatus


def make_paged(num_blocks: int, block_size: int = 4, budget: int = 16, max_num_seqs: int = 8,
               chunked: bool = True, prefix: bool = False) -> PagedBatching:
    config = EngineConfig(model="unused", batching="paged", max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=budget, block_size=block_size,
                          enable_chunked_prefill=chunked, enable_prefix_caching=prefix)
    pool = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    sched = SCHEDULERS["paged"](config, pool)
    assert isinstance(sched, PagedBatching)
    return sched


def make_seq(seq_id: int, prompt: list[int] | int, max_new: int = 4) -> Sequence:
    tokens = prompt if isinstance(prompt, list) else [100 + seq_id] * prompt
    return Sequence(seq_id, tokens, SamplingParams(max_new_tokens=max_new, ignore_eos=True))


def run_step(sched: PagedBatching):
    batch = sched.schedule()
    sched.check_integrity()
    if batch is None:
        return None
    # The token depends only on the sequence and position, as a deterministic model's would.
    samples = [SampledToken(7 + s.num_tokens % 5, 0.0) if batch.is_sampled(i) else None
               for i, s in enumerate(batch.seqs)]
    sched.postprocess(batch, samples)
    sched.check_integrity()
    return batch


def drain(sched: PagedBatching, max_steps: int = 10_000) -> list:
    batches = []
    while sched.has_unfinished():
        batches.append(run_step(sched))
        assert len(batches) < max_steps, "scheduler made no progress"
    return batches


def test_blocks_are_taken_on_demand_and_returned() -> None:
    """A sequence holds ceil(tokens / block_size) blocks and returns all of them."""
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(0, 5)
    bm.allocate(seq, 5)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    seq.num_computed_tokens = 5
    bm.allocate(seq, 3)  # positions 5..7 fit in block 2
    assert len(seq.block_table) == 2
    bm.allocate(seq, 4)
    assert len(seq.block_table) == 3
    bm.check_integrity([seq])
    bm.free(seq)
    bm.check_integrity([])
    assert bm.num_free_blocks == 8


def test_prefix_cache_shares_full_blocks_and_evicts_lru() -> None:
    """Full prompt blocks are shared by refcount; cached blocks are evicted oldest first."""
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks + 2
    a = make_seq(0, prompt)
    assert bm.match_prefix(a) == 0
    bm.allocate(a, 10)
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)
    b = make_seq(1, prompt + [99])
    assert bm.match_prefix(b) == 8 and b.block_table == a.block_table[:2]
    bm.check_integrity([a, b])
    assert bm.prefix_hits == 2
    bm.free(a)
    bm.free(b)
    bm.check_integrity([])
    assert bm.num_free_blocks == 6
    c = make_seq(2, 24)  # needs every block: cached ones are evicted
    bm.allocate(c, 24)
    bm.check_integrity([c])
    d = make_seq(3, prompt)
    bm.free(c)
    assert bm.match_prefix(d) == 0  # the cached prefix is gone


def test_prefix_match_always_leaves_a_token_to_compute() -> None:
    """A prompt made of whole cached blocks still computes its last token."""
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    a = make_seq(0, list(range(8)))
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    b = make_seq(1, list(range(8)))
    assert bm.match_prefix(b) == 4


@pytest.mark.parametrize("budget", [1, 2, 3, 16])
def test_chunked_prefill_respects_budget_and_never_stalls_decodes(budget: int) -> None:
    """Each step holds every running decode plus at most the budget's worth of prefill."""
    sched = make_paged(num_blocks=64, budget=budget)
    sched.add(make_seq(0, 3, max_new=30))
    while not sched.running or sched.running[0].num_output_tokens == 0:
        run_step(sched)
    sched.add(make_seq(1, 40, max_new=2))
    for batch in drain(sched):
        decodes = batch.num_decode_tokens
        assert batch.num_prefill_tokens <= max(budget - decodes, 0) or decodes == 0
        running_decoder = [s for s in batch.seqs if s.seq_id == 0]
        if sched.running and sched.running[0].seq_id == 0:
            assert running_decoder, "the running decode was left out of a step"


def test_unchunked_prefill_runs_a_long_prompt_whole() -> None:
    """With chunking off, a prompt longer than the budget runs in one step."""
    sched = make_paged(num_blocks=64, budget=8, chunked=False)
    sched.add(make_seq(0, 30, max_new=1))
    batch = run_step(sched)
    assert batch.num_scheduled_tokens == (30,)


def test_forced_preemption_loses_nothing_and_leaks_nothing() -> None:
    """A pool of a few blocks and many long sequences: preemptions happen, all finish."""
    sched = make_paged(num_blocks=12, block_size=4, budget=16, max_num_seqs=10)
    seqs = [make_seq(i, 10 + i, max_new=20) for i in range(12)]
    for seq in seqs:
        sched.add(seq)
    drain(sched)
    assert sched.num_preemptions > 0
    assert all(s.finish_reason is FinishReason.LENGTH and s.num_output_tokens == 20 for s in seqs)
    assert sched.allocator.num_free_blocks == 12


def test_preempted_sequences_go_ahead_of_new_arrivals() -> None:
    """A preempted sequence is re-queued at the front of the waiting queue."""
    sched = make_paged(num_blocks=4, block_size=4, budget=16, max_num_seqs=4)
    sched.add(make_seq(0, 6, max_new=8))
    sched.add(make_seq(1, 6, max_new=8))
    run_step(sched)
    sched.add(make_seq(2, 2))
    while sched.num_preemptions == 0:
        run_step(sched)
    assert sched.waiting[0].seq_id == 1 and sched.waiting[0].num_preemptions == 1


@pytest.mark.parametrize("prefix", [False, True])
def test_random_workload_with_aborts_and_preemption_drains_clean(prefix: bool) -> None:
    """Random prompts sharing prefixes, aborts and a tight pool: every block ends free."""
    rng = random.Random(1)
    sched = make_paged(num_blocks=20, block_size=4, budget=rng.choice([5, 9]), max_num_seqs=6,
                       prefix=prefix)
    seqs: list[Sequence] = []
    shared = [rng.randint(1, 50) for _ in range(12)]
    for step_no in range(3000):
        if step_no < 200 and rng.random() < 0.3:
            prompt = shared[:rng.randint(0, 12)] + [rng.randint(1, 50) for _ in range(5)]
            seq = make_seq(len(seqs), prompt, max_new=rng.randint(1, 25))
            seqs.append(seq)
            sched.add(seq)
        if seqs and rng.random() < 0.05:
            sched.finish(rng.choice(seqs), FinishReason.ABORT)
            sched.check_integrity()
        run_step(sched)
        if step_no > 200 and not sched.has_unfinished():
            break
    assert not sched.has_unfinished()
    assert all(s.status is SequenceStatus.FINISHED and not s.block_table for s in seqs)
    bm = sched.allocator
    assert bm.num_free_blocks == bm.num_blocks and all(r == 0 for r in bm._ref)
    if prefix:
        assert bm.prefix_hits > 0


def test_a_prompts_last_token_is_counted_as_prefill_after_the_step_too() -> None:
    """A 9-token prompt under a budget of 8 ends with a 1-token chunk: prefill, also when the
    step's facts are read after it ran (its first output makes it look like a decode then)."""
    sched = make_paged(num_blocks=16, budget=8)
    sched.add(make_seq(0, 9, max_new=3))
    kinds = []
    while sched.has_unfinished():
        batch = run_step(sched)
        kinds.append((batch.num_prefill_tokens, batch.num_decode_tokens))
    assert kinds == [(8, 0), (1, 0), (0, 1), (0, 1)]
