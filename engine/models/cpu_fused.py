"""A decoder layer's small ops through the fused C kernels (engine/kernels/fused_ops.c).

Used on CPU in float32 together with the cpu_paged attention backend (one compiled library);
the reference backend keeps the model on PyTorch ops only, so that path stays the one checked
against transformers op for op.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from engine.kernels import load_kernels
from engine.models.layers import RMSNorm, apply_rope

if TYPE_CHECKING:
    from engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

# logits [S, vocab] float32 → [S, 2] float64: argmax id, its log-probability (runner/sampler.py)
GreedyKernel = Callable[[torch.Tensor], torch.Tensor]


class FusedOps(Protocol):
    """What a layer's fused path calls (the C ops here, the Triton ones in triton_fused.py),
    and a greedy sampling kernel where one comes with them."""

    greedy: GreedyKernel | None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor: ...

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                   num_heads: int) -> torch.Tensor: ...


class FusedCpuOps:
    """RMSNorm (with the residual add before it), RoPE + KV write and greedy sampling, one C
    call each."""

    def __init__(self) -> None:
        self.lib = load_kernels()
        self.greedy: GreedyKernel | None = self._greedy

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, hidden] → weight * x / rms(x). With `residual`, x += residual first (x must be
        a tensor the caller owns: it then holds the layer's new residual stream)."""
        out = torch.empty_like(x)  # [N, hidden]
        self.lib.batchyard_add_rms_norm(
            x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
            out.data_ptr(), x.shape[0], x.shape[1], eps, torch.get_num_threads())
        return out

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                   num_heads: int) -> torch.Tensor:
        """qkv [N, (H + 2 Hkv) * D] → rotated q [N, H, D]; rotated k and v go to the pool."""
        n, (_, kv_heads, head_dim) = qkv.shape[0], k_cache.shape
        q = torch.empty(n, num_heads, head_dim)  # [N, H, D]
        self.lib.batchyard_rope_store(
            qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(), slots.data_ptr(), n, num_heads, kv_heads, head_dim,
            torch.get_num_threads())
        return q

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [S, vocab] float32 → [S, 2] float64: argmax id, its log-probability; the
        log-probability is NaN where a row holds NaN or infinity (PyTorch defines those)."""
        logits = logits.contiguous()
        rows, vocab = logits.shape
        out = torch.empty(rows, 2, dtype=torch.float64)  # [S, 2]
        self.lib.batchyard_greedy(logits.data_ptr(), rows, vocab, out.data_ptr(),
                                  torch.get_num_threads())
        return out


def fused_ops_for(model: torch.nn.Module, dtype: torch.dtype,
                  attention_name: str) -> FusedCpuOps | None:
    """The fused ops when they apply (float32, cpu_paged) and agree with PyTorch, else None."""
    if dtype != torch.float32 or attention_name != "cpu_paged":
        return None
    try:
        ops = FusedCpuOps()
        _check(ops, model)
    except (RuntimeError, AssertionError) as err:
        logger.warning("fused CPU ops unavailable (%s); the layers use PyTorch ops", err)
        return None
    return ops


@torch.inference_mode()
def _check(ops: FusedCpuOps, model: torch.nn.Module) -> None:
    """RoPE bit for bit; RMSNorm and the greedy logprob to rounding; the argmax exactly; on
    the first layer's shapes."""
    native = cast("LlamaForCausalLM", model)  # only native models take the fused ops
    layer: Any = native.layers[0]  # a DecoderLayer, whose norms are Llama's or Gemma's
    spec = native.spec
    generator = torch.Generator().manual_seed(0)
    n, d = 3, spec.head_dim
    heads = spec.num_heads + 2 * spec.num_kv_heads
    qkv = torch.randn(n, heads * d, generator=generator)
    cos, sin = torch.randn(n, d, generator=generator), torch.randn(n, d, generator=generator)
    k_cache, v_cache = (torch.zeros(n, spec.num_kv_heads, d) for _ in range(2))
    q = ops.rope_store(qkv, cos, sin, k_cache, v_cache, torch.arange(n), spec.num_heads)
    rotated = apply_rope(qkv.view(n, heads, d)[:, :heads - spec.num_kv_heads], cos[:, None],
                         sin[:, None])
    assert torch.equal(torch.cat([q, k_cache], 1), rotated), "RoPE differs from PyTorch's"
    assert torch.equal(v_cache.flatten(1), qkv[:, -spec.num_kv_heads * d:]), "V write differs"
    x = torch.randn(n, spec.hidden_size, generator=generator)
    # the op the kernel replaces (Llama's RMSNorm), whatever norm this model's layers use
    norm = RMSNorm(spec.hidden_size, layer.post_attention_layernorm.eps)
    norm.weight.data = torch.randn(spec.hidden_size, generator=generator)
    error = (ops.rms_norm(x.clone(), norm.weight, norm.eps) - norm(x)).abs().max().item()
    assert error <= 1e-5 * norm(x).abs().max().item(), f"RMSNorm differs by {error:.2g}"
    logits = 5 * torch.randn(n, spec.vocab_size, generator=generator)
    ids, logprobs = ops._greedy(logits).unbind(1)
    want = torch.log_softmax(logits, -1).max(-1)
    assert torch.equal(ids.long(), logits.argmax(-1)), "greedy argmax differs"
    assert torch.allclose(logprobs.float(), want.values, atol=1e-4), "logprob differs"
