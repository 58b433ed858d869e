"""The fused Triton small ops (engine/kernels/triton_ops.py), on the CPU through Triton's
interpreter: residual add + RMSNorm, RoPE + the KV write, SiLU x mul against PyTorch's ops on
random inputs; the start-up check and its fallback; an engine whose layers run them serves
transformers' greedy tokens (tests/test_attention_triton.py runs every strategy with them)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from engine import SamplingParams
from engine.models.layers import RMSNorm, apply_rope
from engine.models.triton_fused import FusedTritonOps, triton_fused_ops_for
from tests.engine_harness import drive, hf_greedy, make_engine, staggered_requests
from tests.models_fixtures import build_tiny_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ops() -> FusedTritonOps:
    return FusedTritonOps(CPU)


@pytest.mark.parametrize("hidden", [64, 96])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_rms_norm(ops, hidden, with_residual, dtype) -> None:
    torch.manual_seed(hidden)
    norm = RMSNorm(hidden, 1e-6).to(dtype)
    norm.weight.data = torch.randn(hidden).to(dtype)
    x, residual = torch.randn(7, hidden).to(dtype), torch.randn(7, hidden).to(dtype)
    stream = x.clone()
    got = ops.rms_norm(stream, norm.weight, 1e-6, residual if with_residual else None)
    summed = x + residual if with_residual else x
    atol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, norm(summed), atol=atol, rtol=atol)
    torch.testing.assert_close(stream, summed, atol=0, rtol=0)  # the new residual stream


@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (4, 2), (6, 3)])
@pytest.mark.parametrize("head_dim", [16, 24])
def test_rope_and_kv_write(ops, heads, kv_heads, head_dim) -> None:
    torch.manual_seed(heads * head_dim + kv_heads)
    n = 5
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim)
    cos, sin = torch.randn(n, 1, head_dim), torch.randn(n, 1, head_dim)
    k_cache = torch.full((12, kv_heads, head_dim), 7.0)  # rows not written keep their 7s
    v_cache = torch.full((12, kv_heads, head_dim), 7.0)
    slots = torch.tensor([9, 0, 4, 11, 2])  # scattered
    q = ops.rope_store(qkv, cos, sin, k_cache, v_cache, slots, heads)
    heads_all = qkv.view(n, heads + 2 * kv_heads, head_dim)
    rotated = apply_rope(heads_all[:, :heads + kv_heads], cos, sin)
    torch.testing.assert_close(q, rotated[:, :heads], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_cache[slots], rotated[:, heads:], atol=1e-6, rtol=1e-6)
    assert torch.equal(v_cache[slots], heads_all[:, heads + kv_heads:])
    untouched = [s for s in range(12) if s not in slots.tolist()]
    assert (k_cache[untouched] == 7).all() and (v_cache[untouched] == 7).all()


@pytest.mark.parametrize("inter", [40, 1500])  # one block, and more than one
def test_silu_mul(ops, inter) -> None:
    gate_up = torch.randn(3, 2 * inter)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {"hidden_size": 96}),  # head_dim 24 and hidden 96: padded blocks
    ("qwen3", {}),  # q and k head norms in place before the fused RoPE reads them
])
def test_layers_on_the_triton_ops_serve_transformers_tokens(tmp_path, arch, overrides) -> None:
    """The ops set straight on a model whose engine otherwise runs PyTorch's ops (reference
    attention): staggered greedy requests get transformers' tokens, through the kernels."""
    path = build_tiny_model(tmp_path, arch=arch, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts, new_tokens = [[5, 9, 14, 3, 77, 21, 8], [40], [12, 13, 99, 4]], [6, 5, 4]
    refs = [hf_greedy(hf, p, n) for p, n in zip(prompts, new_tokens, strict=True)]
    engine = make_engine(path, "paged", attention_backend="reference")
    ops = FusedTritonOps(CPU)
    calls: dict[str, int] = {}
    for name in ("rms_norm", "rope_store", "silu_mul"):  # count the calls: the kernels ran
        setattr(ops, name, _counted(calls, name, getattr(ops, name)))
    engine.runner.model.use_fused_cpu_ops(ops)
    reqs = staggered_requests(prompts, new_tokens, [0, 1, 3])
    drive(engine, reqs)
    assert [r.tokens for r in reqs] == refs
    assert set(calls) == {"rms_norm", "rope_store", "silu_mul"}


def _counted(calls: dict[str, int], name: str, op):
    def counted(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return op(*args, **kwargs)
    return counted


def test_a_disagreeing_kernel_leaves_the_pytorch_ops_on(tmp_path, monkeypatch, caplog) -> None:
    engine = make_engine(build_tiny_model(tmp_path), "paged", attention_backend="triton")
    model = engine.runner.model
    assert isinstance(model.layers[0].fused, FusedTritonOps)  # chosen with the backend
    assert triton_fused_ops_for(model, torch.float32, CPU) is not None
    from engine.kernels import triton_ops

    real = triton_ops.silu_mul
    monkeypatch.setattr(triton_ops, "silu_mul", lambda gate_up: real(gate_up) * 1.01)
    with caplog.at_level(logging.WARNING):
        assert triton_fused_ops_for(model, torch.float32, CPU) is None
    assert "SiLU x mul differs" in caplog.text
    assert triton_fused_ops_for(model, torch.bfloat16, CPU) is None  # no bf16 interpreted


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_compiled_ops_pass_their_check_on_cuda(tmp_path, dtype) -> None:
    """Compiled for the GPU, in the engine's dtype: the start-up check passes (the layers use
    them) and a CUDA-graphed engine still serves."""
    engine = make_engine(build_tiny_model(tmp_path), "paged", attention_backend="triton",
                         device="cuda", dtype=dtype)
    assert isinstance(engine.runner.model.layers[0].fused, FusedTritonOps)
    engine.add_request("r", [5, 6, 7], SamplingParams(max_new_tokens=4))
    while engine.has_unfinished():
        engine.step()
