"""A decoder layer's small ops as Triton kernels: residual add + RMSNorm, RoPE + the KV write,
SiLU x mul; one launch each where PyTorch takes three to seven.

Import only after engine.kernels.triton_setup.import_triton(device) (compiled on CUDA,
interpreted on the CPU). Each kernel rounds where PyTorch's op-by-op path rounds (to the
tensor's dtype after every op), so bfloat16 results match PyTorch's; float32 matches to the last
bits (a GPU may contract a multiply-add into one rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm(x_ptr, residual_ptr, weight_ptr, out_ptr, hidden, eps,
                  HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * hidden + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:  # x += residual, in x's dtype: x then holds the new residual stream
        r = tl.load(residual_ptr + row * hidden + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * hidden + cols, x, mask=ok)
    h = x.to(tl.float32)
    rms = tl.rsqrt(tl.sum(h * h, 0) / hidden + eps)
    normed = (h * rms).to(x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * hidden + cols, out, mask=ok)


@triton.jit
def _rope_store(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, slots_ptr, stride_qkv,
                stride_cos, NUM_HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                HEAD_DIM: tl.constexpr, HEADS_P: tl.constexpr, DIM_P: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_P)  # q heads then k heads: both rotated
    dims = tl.arange(0, DIM_P)
    half = HEAD_DIM // 2
    rotated = NUM_HEADS + KV_HEADS
    ok = (heads[:, None] < rotated) & (dims[None, :] < HEAD_DIM)
    base = qkv_ptr + row * stride_qkv + heads[:, None] * HEAD_DIM
    x = tl.load(base + dims[None, :], mask=ok, other=0.0)
    # rotate half: (-x2, x1)
    partner = tl.where(dims < half, dims + half, dims - half)
    sign = tl.where(dims < half, -1.0, 1.0)
    other = tl.load(base + partner[None, :], mask=ok, other=0.0)
    c = tl.load(cos_ptr + row * stride_cos + dims, mask=dims < HEAD_DIM, other=0.0)
    s = tl.load(sin_ptr + row * stride_cos + dims, mask=dims < HEAD_DIM, other=0.0)
    dtype = qkv_ptr.dtype.element_ty
    a = (x.to(tl.float32) * c.to(tl.float32)[None, :]).to(dtype)
    b = ((other.to(tl.float32) * sign[None, :]).to(dtype).to(tl.float32)
         * s.to(tl.float32)[None, :]).to(dtype)
    out = (a.to(tl.float32) + b.to(tl.float32)).to(dtype)
    is_q = heads[:, None] < NUM_HEADS
    tl.store(q_ptr + row * NUM_HEADS * HEAD_DIM + heads[:, None] * HEAD_DIM + dims[None, :],
             out, mask=ok & is_q)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    kv_row = slot * KV_HEADS * HEAD_DIM
    k_heads = heads[:, None] - NUM_HEADS
    tl.store(k_ptr + kv_row + k_heads * HEAD_DIM + dims[None, :], out, mask=ok & ~is_q)
    v_ok = (heads[:, None] < KV_HEADS) & (dims[None, :] < HEAD_DIM)
    v = tl.load(qkv_ptr + row * stride_qkv + (rotated + heads[:, None]) * HEAD_DIM
                + dims[None, :], mask=v_ok, other=0.0)
    tl.store(v_ptr + kv_row + heads[:, None] * HEAD_DIM + dims[None, :], v, mask=v_ok)


@triton.jit
def _silu_mul(gate_up_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    g = tl.load(gate_up_ptr + row * 2 * inter + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + row * 2 * inter + inter + cols, mask=ok, other=0.0)
    dtype = out_ptr.dtype.element_ty
    silu = (g / (1.0 + tl.exp(-g))).to(dtype)  # F.silu, rounded as PyTorch rounds it
    tl.store(out_ptr + row * inter + cols, (silu.to(tl.float32) * u.to(tl.float32)).to(dtype),
             mask=ok)


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, hidden] → weight * x / rms(x); with `residual`, x += residual first, in place."""
    assert x.is_contiguous() and (residual is None or residual.is_contiguous())
    rows, hidden = x.shape
    out = torch.empty_like(x)  # [N, hidden]
    if rows:
        block = triton.next_power_of_2(hidden)
        _add_rms_norm[(rows,)](x, x if residual is None else residual, weight, out, hidden, eps,
                               HAS_RESIDUAL=residual is not None, BLOCK=block,
                               num_warps=_warps(block))
    return out


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int) -> torch.Tensor:
    """qkv [N, (H + 2 Hkv) * D] → rotated q [N, H, D]; rotated k and v written to the pool
    rows `slots` (cos/sin: [N, D] rows, or [N, 1, D])."""
    rows = qkv.shape[0]
    _, kv_heads, head_dim = k_cache.shape
    assert qkv.stride(1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    cos, sin = cos.reshape(rows, -1), sin.reshape(rows, -1)  # [N, D]
    assert cos.shape[1] == head_dim and cos.stride() == sin.stride() and cos.stride(1) == 1
    q = torch.empty(rows, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)  # [N, H, D]
    if rows:
        heads_p = triton.next_power_of_2(num_heads + kv_heads)
        dim_p = triton.next_power_of_2(head_dim)
        _rope_store[(rows,)](qkv, cos, sin, q, k_cache, v_cache, slots, qkv.stride(0),
                             cos.stride(0), NUM_HEADS=num_heads, KV_HEADS=kv_heads,
                             HEAD_DIM=head_dim, HEADS_P=heads_p, DIM_P=dim_p,
                             num_warps=_warps(heads_p * dim_p))
    return q


def _warps(block: int) -> int:
    """Warps (a power of two) for a program holding `block` elements: 8 a thread up to 16
    warps, so a whole row of a large model (hidden 8192; 64 + 8 heads x 128) is spread over
    enough threads to stay in registers; the interpreter ignores it."""
    return min(16, max(1, block // 256))


SILU_BLOCK = 1024  # columns a program takes: intermediate sizes run to tens of thousands


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2I] (gate, then up) → silu(gate) * up [N, I]."""
    assert gate_up.is_contiguous()
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)  # [N, I]
    if rows:
        block = min(SILU_BLOCK, triton.next_power_of_2(inter))
        _silu_mul[(rows, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block)
    return out
