"""The fused CPU ops (engine/kernels/fused_ops.c) against the PyTorch ops they replace, when the
engine turns them on, and that a kernel which disagrees is never used."""

from __future__ import annotations

import pytest
import torch

import engine.kernels as kernels
from engine.attention import store_kv
from engine.models.cpu_fused import FusedCpuOps, fused_ops_for
from engine.models.llama import RMSNorm, apply_rope
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
    model = make_engine(build_tiny_model(tmp_path), "paged").runner.model
    assert all(layer.fused is not None for layer in model.layers)
    assert fused_ops_for(model, torch.bfloat16, "cpu_paged") is None
    assert fused_ops_for(model, torch.float32, "reference") is None
    reference = make_engine(tmp_path, "paged", attention_backend="reference").runner.model
    assert all(layer.fused is None for layer in reference.layers)


def test_a_fused_op_that_disagrees_is_not_used(tmp_path, monkeypatch, caplog) -> None:
    model = make_engine(build_tiny_model(tmp_path), "paged").runner.model
    wrong = FusedCpuOps.rope_store

    def off_by_one(self, *args):
        return wrong(self, *args) + 1.0

    monkeypatch.setattr(FusedCpuOps, "rope_store", off_by_one)
    assert fused_ops_for(model, torch.float32, "cpu_paged") is None
    assert "RoPE differs" in caplog.text
