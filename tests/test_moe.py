"""Sparse mixture-of-experts natively (Mixtral, Qwen3-MoE): the router and the experts are
checked against transformers in every strategy by test_equivalence; here preemption, the
eager decode they need, and what is refused."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine_harness import Req, drive, greedy, hf_greedy, make_engine
from tests.models_fixtures import build_tiny_model


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_preempted_and_planned_ahead_expert_models_equal_generate(tmp_path, arch) -> None:
    path = build_tiny_model(tmp_path, arch=arch)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [list(range(4 + i, 30 + 3 * i)) for i in range(4)]
    refs = [hf_greedy(model, p, 10) for p in prompts]
    engine = make_engine(path, "paged", block_size=4, num_kv_blocks=26, async_scheduling=True,
                         padded_decode_on_cpu=True)
    assert type(engine.runner.model).__name__ == "LlamaForCausalLM"
    assert engine.runner.padded_decode is None  # routing reads the host: decode stays eager
    reqs = [Req(f"r{i}", p, greedy(10)) for i, p in enumerate(prompts)]
    drive(engine, reqs)
    assert engine.scheduler.num_preemptions > 0
    assert [r.tokens for r in reqs] == refs


def test_int8_and_dense_layers_among_experts_are_refused_or_take_the_fallback(tmp_path) -> None:
    path = build_tiny_model(tmp_path / "mixtral", arch="mixtral")
    with pytest.raises(ValueError, match="quantize='int8'.*sparse experts"):
        make_engine(path, "paged", quantize="int8")
    mixed = build_tiny_model(tmp_path / "qwen3-moe", arch="qwen3_moe", mlp_only_layers=[1])
    with pytest.raises(ValueError, match="dense MLP layers among its expert layers"):
        make_engine(mixed, "paged", model_impl="native")
    engine = make_engine(mixed, "paged")
    assert type(engine.runner.model).__name__ == "TransformersModel"
