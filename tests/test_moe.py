"""Sparse mixture-of-experts natively (Mixtral, Qwen3-MoE): the router and the experts are
checked against transformers in every strategy by test_equivalence; here preemption, the
eager decode they need, and what is refused."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.models.moe import MoESettings, SparseMoE
from tests.engine_harness import Req, drive, greedy, hf_greedy, make_engine
from tests.models_fixtures import build_tiny_model


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_preempted_and_planned_ahead_expert_models_equal_generate(tmp_path, arch) -> None:
    path = build_tiny_model(tmp_path, arch=arch)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [list(range(4 + i, 30 + 3 * i)) for i in range(4)]
    refs = [hf_greedy(model, p, 10) for p in prompts]
    engine = make_engine(path, "paged", block_size=4, num_kv_blocks=26, async_scheduling=True)
    assert type(engine.runner.model).__name__ == "LlamaForCausalLM"
    assert engine.runner.padded_decode is None  # on CPU routing reads the host: eager decode
    reqs = [Req(f"r{i}", p, greedy(10)) for i, p in enumerate(prompts)]
    drive(engine, reqs)
    assert engine.scheduler.num_preemptions > 0
    assert [r.tokens for r in reqs] == refs


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_dense_decode_runs_the_graph_path_and_equals_generate(tmp_path, arch) -> None:
    """What CUDA does: pure decode steps run every expert on every token, mixed by the router's
    weights (no host read), through the padded path CUDA graphs replay; prefill stays sparse.
    The tokens equal generate's (test_dense_and_sparse_experts_agree compares the two ways)."""
    path = build_tiny_model(tmp_path, arch=arch)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [list(range(4 + i, 20 + 5 * i)) for i in range(3)]
    refs = [hf_greedy(model, p, 12) for p in prompts]
    engine = make_engine(path, "continuous", padded_decode_on_cpu=True)
    padded = engine.runner.padded_decode
    assert padded is not None and engine.runner.model.graph_safe
    assert not engine.runner.model.syncs_host
    # prompt tokens stay off the padded path: there they would run every expert densely
    assert not padded.prompt_rows and padded.batch_buckets[-1] == engine.config.max_num_seqs
    runner, prompt_steps = engine.runner, []
    choose = runner._padded
    runner._padded = lambda plan: (prompt_steps.append(choose(plan)) if plan.prefills
                                   else None) or choose(plan)
    reqs = [Req(f"r{i}", p, greedy(12), i) for i, p in enumerate(prompts)]
    drive(engine, reqs)
    assert padded.steps > 0 and prompt_steps and not any(prompt_steps)
    assert [r.tokens for r in reqs] == refs


def test_dense_and_sparse_experts_agree() -> None:
    settings = MoESettings(6, 2, 16, True, False, 24)
    moe = SparseMoE(32, 16, settings, 24)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=generator))
    x = torch.randn(7, 32, generator=generator)
    moe.dense_decode = True
    dense, sparse = moe(x, decode_only=True), moe(x, decode_only=False)
    assert torch.allclose(dense, sparse, atol=1e-5, rtol=1e-5)


def test_int8_and_dense_layers_among_experts_are_refused_or_take_the_fallback(tmp_path) -> None:
    path = build_tiny_model(tmp_path / "mixtral", arch="mixtral")
    with pytest.raises(ValueError, match="quantize='int8'.*sparse experts"):
        make_engine(path, "paged", quantize="int8")
    mixed = build_tiny_model(tmp_path / "qwen3-moe", arch="qwen3_moe", mlp_only_layers=[1])
    with pytest.raises(ValueError, match="dense MLP layers among its expert layers"):
        make_engine(mixed, "paged", model_impl="native")
    engine = make_engine(mixed, "paged")
    assert type(engine.runner.model).__name__ == "TransformersModel"
