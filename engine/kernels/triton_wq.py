"""Weight-only quantized linears: y = x @ dequant(W)ᵀ (+ bias) in one Triton GEMM that
dequantizes the int4 / int8 weight tile by tile in registers, so the full-precision weight is
never written to memory (decode is bound by reading weights: 4 bits read a quarter of bf16's).

The weight layout is the loader's, fixed:
  codes  uint8 [N, K // 2] (bits 4: input column 2j in byte j's low nibble, 2j + 1 in its high
         nibble) or [N, K] (bits 8); unsigned codes 0 .. 2^bits - 1
  scales [N, K // G] (float32, or the checkpoint's float16 / bfloat16), zeros uint8
         [N, K // G] (symmetric formats store 2^(bits - 1)),
         group g covering input columns [g G, (g + 1) G)
  W[n, k] = (codes[n, k] - zeros[n, k // G]) * scales[n, k // G], in float32.

Unlike engine/kernels/triton_ops.py this module imports without Triton: `dequantize` (plain
PyTorch) is the fallback wherever Triton does not run, and importing Triton here would fix its
mode (compiled or interpreted) for the process before engine.kernels.triton_setup chose it.
The kernel is built on first use, after import_triton(x.device) (compiled on CUDA, interpreted
on the CPU; the interpreter has no bfloat16).
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import torch

from engine.kernels.triton_setup import TritonUnavailable, import_triton, interpreting

BITS = (4, 8)
GROUP_MULTIPLE = 16  # tl.dot's smallest K: a K block never straddles two groups
BLOCK_N = 64  # output features a program takes
MAX_BLOCK_K = 64  # input columns a loop step takes (the largest power of two dividing G, ≤ 64)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def pack_int4(codes_nk: torch.Tensor) -> torch.Tensor:
    """codes [N, K] uint8 in 0..15 → [N, K // 2]: column 2j in byte j's low nibble, 2j + 1 in
    its high nibble (the loader's layout; tests and converters build weights with it)."""
    if codes_nk.dtype != torch.uint8 or codes_nk.dim() != 2 or codes_nk.shape[1] % 2:
        raise ValueError(f"codes must be uint8 [N, K] with K even, not {codes_nk.dtype} "
                         f"{list(codes_nk.shape)}")
    if codes_nk.numel() and int(codes_nk.max()) > 15:
        raise ValueError(f"codes must be 4-bit (0..15), not up to {int(codes_nk.max())}")
    return codes_nk[:, 0::2] | (codes_nk[:, 1::2] << 4)  # [N, K // 2]


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """packed [N, K // 2] uint8 → codes [N, K] uint8 in 0..15 (pack_int4's inverse)."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"packed must be uint8 [N, K // 2], not {packed.dtype} "
                         f"{list(packed.shape)}")
    pairs = torch.stack((packed & 0xF, packed >> 4), dim=-1)  # [N, K // 2, 2]: (low, high)
    return pairs.reshape(packed.shape[0], 2 * packed.shape[1])  # [N, K]


def dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               group_size: int, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight W [N, K] in `dtype`, computed in float32: the reference for the kernel and
    the engine's path where Triton does not run (one pass over [N, K // G, G] views, no
    per-group loop and no [N, K] copies of the scales)."""
    width = codes.shape[1] * (2 if bits == 4 else 1) if codes.dim() == 2 else 0
    _check_weight(codes, scales, zeros, group_size, bits, width)
    q = unpack_int4(codes) if bits == 4 else codes  # [N, K] uint8
    n, k = q.shape
    w = q.reshape(n, k // group_size, group_size).to(torch.float32)  # [N, groups, G]
    w.sub_(zeros.to(torch.float32)[:, :, None]).mul_(scales.float()[:, :, None])
    return w.view(n, k).to(dtype)


def wq_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              group_size: int, bits: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(W)ᵀ (+ bias) → [..., N] in x's dtype, accumulated in float32, on
    x's device through Triton (TritonUnavailable where it cannot run, bfloat16 on the CPU
    included: use dequantize there)."""
    if x.dtype not in DTYPES:
        raise ValueError(f"x must be float32, float16 or bfloat16, not {x.dtype}")
    if x.dim() < 1:
        raise ValueError("x must be [..., K], not a scalar")
    k = x.shape[-1]
    _check_weight(codes, scales, zeros, group_size, bits, k)
    n = codes.shape[0]
    if bias is not None and (bias.shape != (n,) or not bias.is_floating_point()):
        raise ValueError(f"bias must be a float [N] = [{n}], not {bias.dtype} "
                         f"{list(bias.shape)}")
    for name, t in (("codes", codes), ("scales", scales), ("zeros", zeros), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)  # [M, K]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    if m and n:
        if k == 0:
            out.copy_(bias.expand(m, n) if bias is not None else torch.zeros_like(out))
        else:
            _launch(x2, codes.contiguous(), scales.contiguous(), zeros.contiguous(), bias,
                    out, group_size, bits)
    return out.view(*lead, n)


def _check_weight(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  group_size: int, bits: int, k: int) -> None:
    """ValueError naming the first tensor or number that breaks the layout for K = `k`: a
    wrong shape would otherwise read past a tensor's end in the kernel, silently."""
    if bits not in BITS:
        raise ValueError(f"bits must be 4 or 8, not {bits}")
    if group_size <= 0 or group_size % GROUP_MULTIPLE:
        raise ValueError(f"group_size must be a positive multiple of {GROUP_MULTIPLE}, not "
                         f"{group_size}")
    if k % group_size:
        raise ValueError(f"K = {k} is not a multiple of group_size {group_size}")
    if codes.dim() != 2 or codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8 [N, K{' // 2' if bits == 4 else ''}], not "
                         f"{codes.dtype} {list(codes.shape)}")
    n = codes.shape[0]
    width = k // 2 if bits == 4 else k
    if codes.shape[1] != width:
        raise ValueError(f"codes must be [N, K{' // 2' if bits == 4 else ''}] = [{n}, {width}] "
                         f"for {bits} bits and K = {k}, not {list(codes.shape)}")
    groups = k // group_size
    if scales.shape != (n, groups) or scales.dtype not in DTYPES:
        raise ValueError(f"scales must be float [N, K // G] = [{n}, {groups}], not "
                         f"{scales.dtype} {list(scales.shape)}")
    if zeros.shape != (n, groups) or zeros.dtype != torch.uint8:
        raise ValueError(f"zeros must be uint8 [N, K // G] = [{n}, {groups}], not "
                         f"{zeros.dtype} {list(zeros.shape)}")


def block_k(group_size: int) -> int:
    """The K block: the largest power of two dividing G, at most MAX_BLOCK_K (≥ 16 since
    G % 16 == 0), so each K block lies in one group and needs one scale and zero per row."""
    return min(MAX_BLOCK_K, group_size & -group_size)


def block_m(m: int) -> int:
    """Rows a program takes: 16 for decode (tl.dot's smallest), up to 64 for prompts."""
    return min(64, max(16, 1 << (m - 1).bit_length()))


def _launch(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
            bias: torch.Tensor | None, out: torch.Tensor, group_size: int, bits: int) -> None:
    """One launch over (M blocks, N blocks) filling out [M, N]."""
    triton = import_triton(x.device)  # before the kernel's build: compiled or interpreted
    if x.dtype == torch.bfloat16 and interpreting(triton):
        # NOTE: not left to the interpreter: it runs bfloat16 without error, on wrong numbers
        raise TritonUnavailable("Triton's interpreter (CPU) has no bfloat16: use dequantize")
    kernel = _build(triton)
    m, k = x.shape
    n = codes.shape[0]
    bm = block_m(m)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, BLOCK_N))
    kernel[grid](
        x, codes, scales, zeros, out if bias is None else bias, out,
        m, n, k, x.stride(0), codes.stride(0), scales.stride(0),
        GROUP=group_size, BITS=bits, HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=BLOCK_N,
        BLOCK_K=block_k(group_size), num_warps=4)


@functools.cache
def _build(triton: ModuleType) -> Any:
    """The jitted kernel, defined once Triton is imported in its mode for this process (a
    closure over `tl`: Triton resolves a kernel's free names through its closure too)."""
    import triton.language as tl

    @triton.jit
    def _wq_matmul(x_ptr, codes_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr,
                   M, N, K, stride_x, stride_codes, stride_groups,
                   GROUP: tl.constexpr, BITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                   IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        row_ok = rows < M
        col_ok = cols < N
        ks = tl.arange(0, BLOCK_K)  # [BK]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):  # K % BLOCK_K == 0: no K mask
            kk = k0 + ks
            x = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :],
                        mask=row_ok[:, None], other=0.0)  # [BM, BK]
            # the weight tile transposed, [BK, BN]: column n of it is W[n, kk]
            if BITS == 4:  # each byte loaded for both its columns, then its nibble shifted out
                byte = tl.load(codes_ptr + cols[None, :] * stride_codes + (kk // 2)[:, None],
                               mask=col_ok[None, :], other=0).to(tl.int32)
                q = (byte >> ((kk % 2) * 4)[:, None]) & 0xF
            else:
                q = tl.load(codes_ptr + cols[None, :] * stride_codes + kk[:, None],
                            mask=col_ok[None, :], other=0).to(tl.int32)
            group = k0 // GROUP  # the K block lies in one group
            scale = tl.load(scales_ptr + cols * stride_groups + group, mask=col_ok,
                            other=0.0).to(tl.float32)  # [BN]
            zero = tl.load(zeros_ptr + cols * stride_groups + group, mask=col_ok,
                           other=0).to(tl.float32)  # [BN]
            w = (q.to(tl.float32) - zero[None, :]) * scale[None, :]  # [BK, BN] float32
            if IEEE:  # float32 in, float32 products (not TF32): matches the reference
                acc = tl.dot(x, w, acc, input_precision="ieee")
            else:  # half inputs feed the tensor cores in their dtype; fp32 accumulation
                acc = tl.dot(x, w.to(x_ptr.dtype.element_ty), acc)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * N + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    return _wq_matmul
