"""Scheduler and allocator units: no torch, fake clock, integrity after every call."""

from __future__ import annotations

import random
import sys

import pytest

from engine.config import EngineConfig
from engine.kv.allocator import ContiguousAllocator
from engine.outputs import SampledToken
from engine.sampling_params import SamplingParams
from engine.scheduler import SCHEDULERS, Scheduler
from engine.sequence import FinishReason, Sequence, SequenceStatus

EOS = 2


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make_scheduler(batching: str, max_num_seqs: int = 4, max_model_len: int = 64,
                   delay_ms: float = 100.0, budget: int | None = None,
                   clock: FakeClock | None = None) -> Scheduler:
    config = EngineConfig(model="unused", batching=batching, max_num_seqs=max_num_seqs,
                          max_batch_delay_ms=delay_ms, max_num_batched_tokens=budget)
    allocator = ContiguousAllocator(num_slots=max_num_seqs, max_model_len=max_model_len)
    return SCHEDULERS[batching](config, allocator, now=clock or FakeClock())


def make_seq(seq_id: int, prompt_len: int = 5, max_new: int = 4, **params) -> Sequence:
    params = SamplingParams(max_new_tokens=max_new, **params)
    return Sequence(seq_id, [10 + i for i in range(prompt_len)], params, frozenset({EOS}))


def fake_samples(batch, token: int = 7) -> list[SampledToken | None]:
    return [SampledToken(token, -0.5) if batch.is_sampled(i) else None
            for i in range(len(batch.seqs))]


def step(sched: Scheduler, token: int = 7):
    batch = sched.schedule()
    sched.check_integrity()
    if batch is None:
        return None, []
    finished = sched.postprocess(batch, fake_samples(batch, token))
    sched.check_integrity()
    return batch, finished


def test_no_batching_runs_one_request_to_completion() -> None:
    """NoBatching never runs two sequences at once and finishes each by length."""
    sched = make_scheduler("none", max_num_seqs=1)
    seqs = [make_seq(i, max_new=3) for i in range(3)]
    for s in seqs:
        sched.add(s)
    order = []
    while sched.has_unfinished():
        batch, _ = step(sched)
        assert len(batch.seqs) == 1
        order.append(batch.seqs[0].seq_id)
    assert order == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert all(s.finish_reason is FinishReason.LENGTH and s.num_output_tokens == 3 for s in seqs)
    assert sched.allocator.num_free_blocks == 1


def test_prefill_schedules_whole_prompt_then_single_tokens() -> None:
    """The first step of a sequence computes its prompt; later steps one token each."""
    sched = make_scheduler("continuous")
    sched.add(make_seq(0, prompt_len=6, max_new=3))
    counts = []
    while sched.has_unfinished():
        batch, _ = step(sched)
        counts.append(batch.num_scheduled_tokens[0])
    assert counts == [6, 1, 1]


def test_dynamic_waits_for_batch_size_or_delay() -> None:
    """A batch starts at batch_size requests, or max_batch_delay after the oldest arrived."""
    clock = FakeClock()
    sched = make_scheduler("dynamic", max_num_seqs=3, delay_ms=100, clock=clock)
    sched.add(make_seq(0))
    assert sched.schedule() is None
    assert sched.wait_hint() == pytest.approx(0.1)
    clock.t += 0.05
    sched.add(make_seq(1))
    assert sched.schedule() is None
    assert sched.wait_hint() == pytest.approx(0.05)
    clock.t += 0.049
    assert sched.schedule() is None
    clock.t += 0.002
    batch, _ = step(sched)
    assert [s.seq_id for s in batch.seqs] == [0, 1]

    sched2 = make_scheduler("dynamic", max_num_seqs=3, delay_ms=10_000, clock=clock)
    for i in range(3):
        sched2.add(make_seq(i))
    batch, _ = step(sched2)
    assert len(batch.seqs) == 3


def test_dynamic_batch_runs_to_completion_and_nobody_joins() -> None:
    """Requests arriving while a dynamic batch runs wait until the whole batch is done."""
    clock = FakeClock()
    sched = make_scheduler("dynamic", max_num_seqs=2, delay_ms=0, clock=clock)
    sched.add(make_seq(0, max_new=2))
    sched.add(make_seq(1, max_new=5))
    step(sched)
    late = make_seq(2, max_new=1)
    sched.add(late)
    seen_late_at = None
    for n in range(1, 20):
        batch, _ = step(sched)
        if late in batch.seqs:
            seen_late_at = n
            break
        assert [s.seq_id for s in batch.seqs] in ([0, 1], [1])
    assert seen_late_at == 5  # after seq 1's remaining 4 decode steps


def test_continuous_admits_and_retires_every_iteration() -> None:
    """A new request joins the running batch at the next step; finished ones leave at once."""
    sched = make_scheduler("continuous", max_num_seqs=2)
    sched.add(make_seq(0, max_new=2))
    sched.add(make_seq(1, max_new=6))
    sched.add(make_seq(2, max_new=2))
    batch, _ = step(sched)
    assert [s.seq_id for s in batch.seqs] == [0, 1]
    batch, finished = step(sched)
    assert [s.seq_id for s in finished] == [0]
    batch, _ = step(sched)
    assert [s.seq_id for s in batch.seqs] == [1, 2]
    assert batch.num_scheduled_tokens == (1, 5)


def test_continuous_respects_prefill_token_budget() -> None:
    """max_num_batched_tokens caps prompt tokens admitted per step; one always fits."""
    sched = make_scheduler("continuous", max_num_seqs=4, budget=8)
    for i in range(3):
        sched.add(make_seq(i, prompt_len=5))
    batch, _ = step(sched)
    assert len(batch.seqs) == 1  # 5 + 5 > 8
    batch, _ = step(sched)
    assert [s.seq_id for s in batch.seqs] == [0, 1]
    big = make_scheduler("continuous", max_num_seqs=4, budget=2)
    big.add(make_seq(0, prompt_len=5))
    batch, _ = step(big)
    assert batch.num_scheduled_tokens == (5,)


def test_eos_finishes_unless_ignored_or_before_min_new_tokens() -> None:
    """EOS ends a sequence, except with ignore_eos or before min_new_tokens."""
    for params, expected_len, reason in [
        ({}, 1, FinishReason.EOS),
        ({"ignore_eos": True}, 4, FinishReason.LENGTH),
        ({"min_new_tokens": 2}, 3, FinishReason.EOS),
    ]:
        sched = make_scheduler("continuous")
        seq = make_seq(0, max_new=4, **params)
        sched.add(seq)
        while sched.has_unfinished():
            step(sched, token=EOS)
        assert (seq.num_output_tokens, seq.finish_reason) == (expected_len, reason)


@pytest.mark.parametrize("batching", ["none", "dynamic", "continuous"])
def test_drained_workload_with_aborts_leaks_nothing(batching: str) -> None:
    """Random arrivals, lengths and aborts: every sequence ends, every block is free."""
    rng = random.Random(0)
    clock = FakeClock()
    slots = 1 if batching == "none" else 3
    sched = make_scheduler(batching, max_num_seqs=slots, delay_ms=5, clock=clock)
    seqs: list[Sequence] = []
    for step_no in range(400):
        if step_no < 150 and rng.random() < 0.4:
            seq = make_seq(len(seqs), prompt_len=rng.randint(1, 20), max_new=rng.randint(1, 12))
            seqs.append(seq)
            sched.add(seq)
        if seqs and rng.random() < 0.1:
            victim = rng.choice(seqs)
            sched.finish(victim, FinishReason.ABORT)
            sched.check_integrity()
        clock.t += 0.002
        step(sched, token=rng.choice([EOS, 5, 6, 7]))
        if step_no > 150 and not sched.has_unfinished():
            break
    assert not sched.has_unfinished()
    assert all(s.status is SequenceStatus.FINISHED and not s.block_table for s in seqs)
    assert sched.allocator.num_free_blocks == sched.allocator.num_blocks
    assert any(s.finish_reason is FinishReason.ABORT for s in seqs)


def test_abort_of_waiting_and_finished_sequences() -> None:
    """Aborting a queued sequence removes it; aborting twice is harmless."""
    sched = make_scheduler("none", max_num_seqs=1)
    a, b = make_seq(0), make_seq(1)
    sched.add(a)
    sched.add(b)
    step(sched)
    sched.finish(b, FinishReason.ABORT)
    sched.finish(b, FinishReason.ABORT)
    sched.check_integrity()
    assert list(sched.waiting) == [] and b.finish_reason is FinishReason.ABORT


def test_contiguous_allocator_integrity_catches_corruption() -> None:
    """check_integrity fails when a block table and the allocator disagree."""
    alloc = ContiguousAllocator(num_slots=2, max_model_len=16)
    seq = make_seq(0)
    assert alloc.can_allocate(seq, 16) and not alloc.can_allocate(seq, 17)
    alloc.allocate(seq, 5)
    alloc.check_integrity([seq])
    other = make_seq(1)
    other.block_table = list(seq.block_table)
    with pytest.raises(AssertionError):
        alloc.check_integrity([seq, other])
    alloc.free(seq)
    alloc.check_integrity([])
    assert alloc.num_free_blocks == 2


def test_scheduler_side_never_imports_torch() -> None:
    """Sequences, allocators and schedulers stay pure Python."""
    import subprocess

    code = ("import sys, engine.scheduler, engine.kv.allocator, engine.sequence, "
            "engine.text.detokenizer;"
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
