"""A decoder layer's small ops through Triton kernels (engine/kernels/triton_ops.py): residual
add + RMSNorm, RoPE + the KV write, SiLU x mul. Used with the triton attention backend, on CUDA
(compiled; inside CUDA graphs too) and on the CPU through Triton's interpreter (for tests);
checked at start-up against the PyTorch ops on the model's own shapes, and left off, loudly,
when they disagree."""

from __future__ import annotations

import logging
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F

from engine.kernels.triton_setup import TritonUnavailable, import_triton
from engine.models.cpu_fused import GreedyKernel
from engine.models.layers import RMSNorm, apply_rope

if TYPE_CHECKING:
    from engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

# Largest |fused - PyTorch| allowed, relative to the largest |PyTorch| value
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


class FusedTritonOps:
    """The fused-ops interface of engine/models/cpu_fused.py (rms_norm, rope_store), plus
    silu_mul; greedy sampling stays the sampler's (already on the device)."""

    def __init__(self, device: torch.device) -> None:
        self.greedy: GreedyKernel | None = None  # the sampler's own runs on the device
        import_triton(device)  # before the kernels' import: compiled or interpreted
        from engine.kernels import triton_ops

        self.kernels: ModuleType = triton_ops

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, hidden] → weight * x / rms(x); with `residual`, x += residual first (in
        place: x then holds the layer's new residual stream)."""
        return self.kernels.add_rms_norm(x, weight, eps, residual)

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                   num_heads: int) -> torch.Tensor:
        """qkv [N, (H + 2 Hkv) * D] → rotated q [N, H, D]; rotated k and v go to the pool."""
        return self.kernels.rope_store(qkv, cos, sin, k_cache, v_cache, slots, num_heads)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [N, 2I] → silu(gate) * up [N, I]."""
        return self.kernels.silu_mul(gate_up)


def triton_fused_ops_for(model: torch.nn.Module, dtype: torch.dtype,
                         device: torch.device) -> FusedTritonOps | None:
    """The Triton ops when they run here and agree with PyTorch on the model's shapes, else
    None (logged: the layers keep PyTorch's ops)."""
    if device.type == "cpu" and dtype == torch.bfloat16:
        logger.warning("fused Triton ops off: Triton's interpreter (CPU) has no bfloat16")
        return None
    try:
        ops = FusedTritonOps(device)
        check_fused_ops(ops, model, dtype, device)
    except (TritonUnavailable, RuntimeError, AssertionError) as err:
        logger.warning("fused Triton ops failed their start-up check (%s); the layers use "
                       "PyTorch ops", err)
        return None
    logger.info("fused Triton ops: residual add + RMSNorm, RoPE + KV write, SiLU x mul")
    return ops


@torch.inference_mode()
def check_fused_ops(ops: FusedTritonOps, model: torch.nn.Module, dtype: torch.dtype,
                    device: torch.device) -> None:
    """Each op against PyTorch's on the first layer's shapes, random inputs (AssertionError
    past the tolerance)."""
    native = cast("LlamaForCausalLM", model)
    layer: Any = native.layers[0]
    spec = native.spec
    generator = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device).to(dtype)

    n, d, heads, kv = 5, spec.head_dim, spec.num_heads, spec.num_kv_heads
    qkv = rand(n, (heads + 2 * kv) * d)
    cos, sin = rand(n, 1, d), rand(n, 1, d)
    k_cache, v_cache = (torch.zeros(n + 3, kv, d, dtype=dtype, device=device) for _ in range(2))
    slots = torch.arange(n, device=device) + 2
    q = ops.rope_store(qkv, cos, sin, k_cache, v_cache, slots, heads)
    want = apply_rope(qkv.view(n, heads + 2 * kv, d)[:, :heads + kv], cos, sin)
    _close("RoPE", torch.cat([q, k_cache[2:2 + n]], 1), want, dtype)
    _close("V write", v_cache[2:2 + n].flatten(1), qkv[:, -kv * d:], dtype)
    norm = RMSNorm(spec.hidden_size, layer.post_attention_layernorm.eps).to(device, dtype)
    norm.weight.data = rand(spec.hidden_size)
    x, residual = rand(n, spec.hidden_size), rand(n, spec.hidden_size)
    stream = x.clone()
    _close("RMSNorm", ops.rms_norm(stream, norm.weight, norm.eps, residual), norm(x + residual),
           dtype)
    _close("residual add", stream, x + residual, dtype)
    gate_up = rand(n, 2 * native.inter)
    gate, up = gate_up.chunk(2, dim=-1)
    _close("SiLU x mul", ops.silu_mul(gate_up), F.silu(gate) * up, dtype)


def _close(what: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    error = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item() or 1.0
    assert error <= TOLERANCE[dtype] * scale, f"{what} differs from PyTorch's by {error:.3g}"
