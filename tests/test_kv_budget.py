"""One KV memory budget for every strategy: contiguous reservation holds fewer sequences."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.kv.allocator import ContiguousAllocator
from engine.kv.block_manager import BlockManager
from engine.kv.budget import build_allocator, plan_kv
from engine.scheduler import SCHEDULERS
from tests.test_scheduler import FakeClock, make_seq, step

BYTES_PER_TOKEN = 1000
MAX_MODEL_LEN = 64


def config(batching: str, **overrides) -> EngineConfig:
    seqs = 1 if batching == "none" else 8
    return EngineConfig(model="unused", batching=batching, **{"max_num_seqs": seqs, **overrides})


@pytest.mark.parametrize("batching", ["dynamic", "continuous", "none"])
def test_contiguous_strategies_hold_budget_over_max_model_len(batching) -> None:
    budget = 3 * MAX_MODEL_LEN * BYTES_PER_TOKEN + 999  # floor(...) = 3 sequences
    cfg = config(batching, kv_cache_memory=budget)
    plan = plan_kv(cfg, MAX_MODEL_LEN, BYTES_PER_TOKEN, default_budget_bytes=10**12)
    assert plan.block_size == MAX_MODEL_LEN and plan.sized_by == "kv_cache_memory"
    assert plan.num_blocks == plan.max_concurrency == min(3, cfg.max_num_seqs)
    assert isinstance(build_allocator(cfg, plan), ContiguousAllocator)


def test_paged_gets_the_same_bytes_in_blocks() -> None:
    budget = 3 * MAX_MODEL_LEN * BYTES_PER_TOKEN
    cfg = config("paged", kv_cache_memory=budget, block_size=16)
    plan = plan_kv(cfg, MAX_MODEL_LEN, BYTES_PER_TOKEN, default_budget_bytes=10**12)
    assert plan.num_blocks == 3 * MAX_MODEL_LEN // 16 and plan.max_concurrency == 3
    assert plan.pool_bytes == budget
    assert isinstance(build_allocator(cfg, plan), BlockManager)


def test_explicit_blocks_win_and_nobody_gets_more_than_max_num_seqs() -> None:
    plan = plan_kv(config("paged", num_kv_blocks=5, kv_cache_memory=10**9), MAX_MODEL_LEN,
                   BYTES_PER_TOKEN, 10**12)
    assert (plan.num_blocks, plan.sized_by) == (5, "num_kv_blocks")
    huge = plan_kv(config("continuous"), MAX_MODEL_LEN, BYTES_PER_TOKEN, 10**12)
    assert huge.num_blocks == 8 and huge.sized_by == "device default"


def test_budget_below_one_sequence_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="less than one block of 64 tokens"):
        plan_kv(config("continuous", kv_cache_memory=BYTES_PER_TOKEN), MAX_MODEL_LEN,
                BYTES_PER_TOKEN, 10**12)


def test_continuous_queues_what_the_budget_cannot_hold() -> None:
    """With room for 2 sequences of max_model_len, 5 requests run 2 at a time; all finish."""
    cfg = config("continuous", kv_cache_memory=2 * MAX_MODEL_LEN * BYTES_PER_TOKEN)
    plan = plan_kv(cfg, MAX_MODEL_LEN, BYTES_PER_TOKEN, 10**12)
    sched = SCHEDULERS["continuous"](cfg, build_allocator(cfg, plan), now=FakeClock())
    seqs = [make_seq(i, max_new=3) for i in range(5)]
    for seq in seqs:
        sched.add(seq)
    widths = []
    while sched.has_unfinished():
        batch, _ = step(sched)
        widths.append(len(batch.seqs))
    assert max(widths) == 2 and all(s.is_finished for s in seqs)
    assert sched.allocator.num_free_blocks == 2
