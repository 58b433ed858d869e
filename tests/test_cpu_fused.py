"""The fused CPU ops (engine/kernels/fused_ops.c, greedy.c) against the PyTorch ops they replace,
when the engine turns them on, and that a kernel which disagrees is never used."""

from __future__ import annotations

import pytest
import torch

import engine.kernels as kernels
from engine.attention.reference import store_kv
from engine.models.cpu_fused import FusedCpuOps, fused_ops_for
from engine.models.layers import RMSNorm, apply_rope
from engine.runner.sampler import Sampler
from engine.runner.step_buffer import StepBuffer
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from tests.engine_harness import make_engine
from tests.models_fixtures import build_tiny_model

pytestmark = pytest.mark.skipif(kernels.compiler() is None, reason="needs a C compiler")


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 16), (9, 3, 64), (4, 4, 8)])
@torch.inference_mode()
def test_rope_store_is_bit_identical_to_pytorch(heads, kv_heads, head_dim) -> None:
    n, slots = 5, torch.tensor([7, 0, 12, 3, 9])
    torch.manual_seed(0)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim)
    cos, sin = torch.randn(n, 1, head_dim), torch.randn(n, 1, head_dim)
    pools = [torch.zeros(16, kv_heads, head_dim) for _ in range(4)]
    q = FusedCpuOps().rope_store(qkv, cos, sin, pools[0], pools[1], slots, heads)
    rotated = apply_rope(qkv.view(n, -1, head_dim)[:, :heads + kv_heads], cos, sin)
    store_kv(rotated[:, heads:], qkv.view(n, -1, head_dim)[:, heads + kv_heads:], pools[2],
             pools[3], slots)
    assert torch.equal(q, rotated[:, :heads])
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])


@torch.inference_mode()
def test_rms_norm_adds_the_residual_in_place_and_normalises() -> None:
    torch.manual_seed(1)
    norm = RMSNorm(48, 1e-5)
    norm.weight.data = torch.randn(48)
    x, residual = torch.randn(6, 48), torch.randn(6, 48)
    ops = FusedCpuOps()
    torch.testing.assert_close(ops.rms_norm(x.clone(), norm.weight, norm.eps), norm(x),
                               atol=1e-6, rtol=1e-6)
    stream = x.clone()
    h = ops.rms_norm(stream, norm.weight, norm.eps, residual=residual)
    assert torch.equal(stream, x + residual)
    torch.testing.assert_close(h, norm(x + residual), atol=1e-6, rtol=1e-6)


def test_on_only_with_the_cpu_kernel_backend_in_float32(tmp_path) -> None:
    runner = make_engine(build_tiny_model(tmp_path), "paged").runner
    model = runner.model
    assert all(layer.fused is not None for layer in model.layers)
    assert runner.sampler.greedy is not None
    assert fused_ops_for(model, torch.bfloat16, "cpu_paged") is None
    assert fused_ops_for(model, torch.float32, "reference") is None
    reference = make_engine(tmp_path, "paged", attention_backend="reference").runner
    assert all(layer.fused is None for layer in reference.model.layers)
    assert reference.sampler.greedy is None


def test_a_fused_op_that_disagrees_is_not_used(tmp_path, monkeypatch, caplog) -> None:
    model = make_engine(build_tiny_model(tmp_path), "paged").runner.model
    wrong = FusedCpuOps.rope_store

    def off_by_one(self, *args):
        return wrong(self, *args) + 1.0

    monkeypatch.setattr(FusedCpuOps, "rope_store", off_by_one)
    assert fused_ops_for(model, torch.float32, "cpu_paged") is None
    assert "RoPE differs" in caplog.text


@torch.inference_mode()
def test_greedy_kernel_matches_argmax_and_log_softmax() -> None:
    torch.manual_seed(2)
    logits = 5 * torch.randn(6, 1000)
    logits[0, 10] = logits[0, 900] = logits[0].max() + 1  # a tie: the first index wins
    logits[1, :500] = float("-inf")  # masked tokens (min_new_tokens' EOS mask)
    logits[2] = 0.0  # all equal
    ids, logprobs = FusedCpuOps().greedy(logits).unbind(1)
    assert torch.equal(ids.long(), logits.argmax(-1)) and ids[0] == 10 and ids[2] == 0
    want = torch.log_softmax(logits, -1).max(-1).values
    torch.testing.assert_close(logprobs.float(), want, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_greedy_kernel_leaves_nan_and_infinity_to_pytorch(bad) -> None:
    logits = torch.randn(3, 100)
    logits[1, 40] = bad
    packed = FusedCpuOps().greedy(logits)
    assert packed[:, 1].isnan().tolist() == [False, True, False]
    seq = Sequence(0, [1, 2], SamplingParams(max_new_tokens=4), frozenset({0}), 0)
    tokens = _sample(Sampler(FusedCpuOps().greedy), logits, [seq] * 3)
    assert [t.token_id for t in tokens] == logits.argmax(-1).tolist()  # PyTorch's path


def _sample(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence]):
    buffer = StepBuffer(torch.device("cpu"))
    plan = sampler.stage(seqs, buffer)
    return sampler(logits, plan, buffer.upload())


def test_sampler_uses_the_greedy_kernel_only_for_plain_greedy_rows() -> None:
    calls = []

    def kernel(logits):
        calls.append(logits.shape[0])
        return torch.tensor([[7.0, -0.5]] * logits.shape[0], dtype=torch.float64)

    def seq(**params):
        return Sequence(0, [1, 2], SamplingParams(max_new_tokens=4, **params), frozenset({0}), 0)

    logits = torch.randn(2, 10)
    sampler = Sampler(kernel)
    assert [t.token_id for t in _sample(sampler, logits, [seq(), seq(min_new_tokens=0)])] == [7, 7]
    for other in ({"top_logprobs": 2}, {"repetition_penalty": 1.3}, {"min_new_tokens": 2},
                  {"do_sample": True, "seed": 1}):
        tokens = _sample(sampler, logits, [seq(), seq(**other)])
        assert tokens[0].token_id == int(logits[0].argmax())  # PyTorch's path for the batch
    assert calls == [2]
