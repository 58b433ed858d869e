"""Phi-3 natively: fused checkpoint tensors, a partly rotated head and LongRoPE, which rotates a
sequence longer than its original context with other factors at every position. transformers
recomputes the cache when a sequence grows past it; so does batchyard (scheduler), and the
tokens equal `generate` for prompts below, across and beyond it, in every strategy."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine_harness import Req, drive, greedy, hf_greedy, make_engine, staggered_requests
from tests.models_fixtures import build_tiny_model

ORIGINAL = 34  # the fixture's original_max_position_embeddings


@pytest.fixture(scope="module")
def phi(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("phi3-longrope"), arch="phi3_longrope")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [list(range(3, 3 + n)) for n in (30, 34, 35, 52)]  # below, at, just past, beyond
    new_tokens = [12, 6, 5, 8]
    refs = [hf_greedy(model, p, n) for p, n in zip(prompts, new_tokens, strict=True)]
    return path, prompts, new_tokens, refs


def requests(prompts, new_tokens) -> list[Req]:
    return staggered_requests(prompts, new_tokens, range(len(prompts)))


CASES = [
    ("none", {}),
    ("continuous", {}),
    ("paged", {"max_num_batched_tokens": 8, "block_size": 4}),  # chunks end below the switch
    ("paged", {"block_size": 4, "num_kv_blocks": 30, "async_scheduling": True}),
]


@pytest.mark.parametrize(("batching", "overrides"), CASES,
                         ids=[f"{b}-{i}" for i, (b, _) in enumerate(CASES)])
def test_sequences_below_across_and_beyond_the_original_context(phi, batching,
                                                                 overrides) -> None:
    path, prompts, new_tokens, refs = phi
    engine = make_engine(path, batching, **overrides)
    assert type(engine.runner.model).__name__ == "LlamaForCausalLM"  # natively
    assert engine.scheduler.long_rope_after == ORIGINAL
    reqs = requests(prompts, new_tokens)
    drive(engine, reqs)
    assert [r.tokens for r in reqs] == refs


def test_crossing_recomputes_the_sequence_once(phi) -> None:
    """A sequence that grows past the original context is recomputed from its first token
    once (a prefill of everything it has), then decodes as usual."""
    path, prompts, _, refs = phi
    engine = make_engine(path, "continuous")
    scheduled = []
    launch = engine.runner.launch
    engine.runner.launch = lambda batch: scheduled.append(batch.num_tokens) or launch(batch)
    reqs = [Req("a", prompts[0], greedy(12))]  # 30 prompt tokens: 35 after the 5th output
    drive(engine, reqs)
    assert reqs[0].tokens == refs[0]
    assert scheduled == [30, 1, 1, 1, 1, ORIGINAL + 1] + [1] * 6


def test_prefix_caching_is_off_only_where_a_sequence_can_cross(phi, caplog) -> None:
    path = phi[0]
    with caplog.at_level(logging.WARNING, logger="engine.scheduler"):
        crossing = make_engine(path, "paged", enable_prefix_caching=True)
    assert not crossing.scheduler.allocator.enable_prefix_caching
    assert "prefix caching is off" in caplog.text
    short = make_engine(path, "paged", enable_prefix_caching=True, max_model_len=ORIGINAL)
    assert short.scheduler.allocator.enable_prefix_caching
    assert short.scheduler.long_rope_after is None


def test_what_the_native_modules_lack_takes_the_fallback_or_is_refused(tmp_path) -> None:
    """A Phi-3 with another activation: auto serves it through the transformers fallback (and
    equals generate); model_impl=native says what it lacks."""
    path = build_tiny_model(tmp_path, arch="phi3", hidden_act="gelu_new")
    with pytest.raises(ValueError, match="activation 'gelu_new'.*model_impl=native"):
        make_engine(path, "paged", model_impl="native")
    engine = make_engine(path, "paged")
    assert type(engine.runner.model).__name__ == "TransformersModel"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reqs = [Req("r", [5, 6, 7, 8, 9], greedy(8))]
    drive(engine, reqs)
    assert reqs[0].tokens == hf_greedy(model, [5, 6, 7, 8, 9], 8)


def test_the_fallback_serves_longrope_models_up_to_their_original_context(phi) -> None:
    """transformers' modules switch LongRoPE factors by the longest position of the whole
    packed batch: exact only while no sequence is longer than the original context."""
    path, prompts, _, refs = phi
    engine = make_engine(path, "paged", model_impl="transformers", max_model_len=None)
    assert engine.max_model_len == ORIGINAL
    reqs = [Req("r", prompts[0], greedy(4))]
    drive(engine, reqs)
    assert reqs[0].tokens == refs[0][:4]
