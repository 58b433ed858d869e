"""The weight-only quantized GEMM (engine/kernels/triton_wq.py), on the CPU through Triton's
interpreter (compiled where CUDA is): int4 and int8 weights against x @ dequantize(...)ᵀ over
decode and prompt row counts, ragged N, one group a row and many, with and without bias; the
int4 packing round trip; the layout checks naming the tensor; the module importing without
Triton (dequantize is the fallback where it does not run)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine.kernels.triton_setup import TritonUnavailable
from engine.kernels.triton_wq import dequantize, pack_int4, unpack_int4, wq_matmul

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def quantized(n: int, k: int, group: int, bits: int, seed: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random codes, scales and zeros in the loader's layout (on the CPU)."""
    gen = torch.Generator().manual_seed(seed)
    top = 2 ** bits
    codes = torch.randint(0, top, (n, k), generator=gen, dtype=torch.uint8)  # [N, K]
    if bits == 4:
        codes = pack_int4(codes)  # [N, K // 2]
    scales = torch.rand(n, k // group, generator=gen) * 0.02 + 0.001  # [N, groups]
    zeros = torch.randint(0, top, (n, k // group), generator=gen, dtype=torch.uint8)
    return codes, scales, zeros


def close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    """|got - want| within `rel` of want's largest magnitude (elementwise relative error is
    meaningless for outputs that sum to near zero)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    err = (got.float() - want.float()).abs().max().item()
    assert err <= rel * want.float().abs().max().item(), err


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m,n,k,group,with_bias", [
    (1, 40, 64, 64, False),  # decode, N not a multiple of BLOCK_N, G = K
    (13, 40, 128, 32, True),  # four groups a row, one K block each
    (3, 72, 96, 48, True),  # G = 48: K blocks of 16; two N blocks, the second ragged
    (33, 17, 64, 16, False),  # one ragged M block of 64; G = 16: K blocks of 16
    (70, 8, 128, 128, True),  # two M blocks of 64, G = K = 128: two K blocks a group
])
def test_matches_dequantized_matmul(bits, m, n, k, group, with_bias) -> None:
    codes, scales, zeros = quantized(n, k, group, bits, seed=m * n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))  # [M, K]
    bias = torch.randn(n) if with_bias else None
    w = dequantize(codes, scales, zeros, group, bits, torch.float32)  # [N, K]
    want = x @ w.T + (bias if bias is not None else 0)
    dev = [t.to(DEVICE) for t in (x, codes, scales, zeros)]
    got = wq_matmul(*dev, group_size=group, bits=bits,
                    bias=None if bias is None else bias.to(DEVICE))
    close(got.cpu(), want, 1e-4)


def test_half_inputs_and_leading_dims() -> None:
    """float16 x feeds tl.dot in float16 (bfloat16 too where compiled: the interpreter has
    none), accumulating in float32; x [B, T, K] keeps its leading dims."""
    bits, n, k, group = 4, 40, 64, 32
    codes, scales, zeros = quantized(n, k, group, bits, seed=5)
    w = dequantize(codes, scales, zeros, group, bits, torch.float32)  # [N, K]
    dtypes = [torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
    for dtype in dtypes:
        x = torch.randn(2, 3, k).to(dtype)  # [B, T, K]
        want = (x.float() @ w.T).to(dtype)  # [B, T, N]
        got = wq_matmul(x.to(DEVICE), codes.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE),
                        group, bits)
        assert got.shape == (2, 3, n)
        close(got.cpu(), want, 1e-2)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the interpreter's limit")
def test_bfloat16_refused_on_the_cpu() -> None:
    """The interpreter runs bfloat16 kernels without error but on wrong numbers (about 1e11
    off here): refused, so callers take dequantize's path."""
    codes, scales, zeros = quantized(40, 64, 32, 4)
    with pytest.raises(TritonUnavailable, match="bfloat16"):
        wq_matmul(torch.randn(3, 64).bfloat16(), codes, scales, zeros, 32, 4)


def test_dequantize_by_definition() -> None:
    """W[n, k] = (code - zero of k's group) * scale of k's group, element by element."""
    n, k, group = 3, 32, 16
    for bits in (4, 8):
        codes, scales, zeros = quantized(n, k, group, bits, seed=bits)
        flat = unpack_int4(codes) if bits == 4 else codes  # [N, K]
        w = dequantize(codes, scales, zeros, group, bits, torch.float16)
        assert w.shape == (n, k) and w.dtype == torch.float16
        for i in range(n):
            for j in (0, 1, 15, 16, 31):
                g = j // group
                ref = (int(flat[i, j]) - int(zeros[i, g])) * scales[i, g].item()
                assert abs(w[i, j].item() - ref) <= 1e-3 * max(1.0, abs(ref))


def test_int4_pack_round_trip() -> None:
    codes = torch.randint(0, 16, (5, 12), dtype=torch.uint8)  # [N, K]
    packed = pack_int4(codes)
    assert packed.shape == (5, 6)
    assert torch.equal(packed[:, 0] & 0xF, codes[:, 0])  # column 2j: the low nibble
    assert torch.equal(packed[:, 0] >> 4, codes[:, 1])  # column 2j + 1: the high nibble
    assert torch.equal(unpack_int4(packed), codes)
    with pytest.raises(ValueError, match="4-bit"):
        pack_int4(torch.full((2, 4), 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="K even"):
        pack_int4(torch.zeros(2, 3, dtype=torch.uint8))


def test_wrong_layouts_raise_naming_the_tensor() -> None:
    n, k, group = 8, 64, 32
    x = torch.randn(2, k)
    codes4, scales, zeros = quantized(n, k, group, 4)
    codes8, _, _ = quantized(n, k, group, 8)
    cases = [
        ((x, codes8, scales, zeros, group, 4), "codes"),  # [N, K] where int4 packs [N, K/2]
        ((x, codes4, scales, zeros, group, 8), "codes"),  # and the reverse
        ((x, codes4.to(torch.int8), scales, zeros, group, 4), "codes"),
        ((x, codes4, scales[:, :1], zeros, group, 4), "scales"),  # [N, 1] for two groups
        ((x, codes4, scales.int(), zeros, group, 4), "scales"),  # float16/bf16/fp32 only
        ((x, codes4, scales, zeros[:4], group, 4), "zeros"),
        ((x, codes4, scales, zeros, 24, 4), "group_size"),
        ((x, codes4, scales, zeros, group, 3), "bits"),
        ((x.int(), codes4, scales, zeros, group, 4), "x must"),
    ]
    for args, name in cases:
        with pytest.raises(ValueError, match=name):
            wq_matmul(*args)
    with pytest.raises(ValueError, match="bias"):
        wq_matmul(x, codes4, scales, zeros, group, 4, bias=torch.zeros(n + 1))
    with pytest.raises(ValueError, match="scales"):
        dequantize(codes4, scales[:, :1], zeros, group, 4, torch.float32)


def test_imports_without_triton() -> None:
    """Importing the module leaves Triton unimported: the process's first import of it fixes
    compiled or interpreted, which engine.kernels.triton_setup decides."""
    code = ("import sys, engine.kernels.triton_wq as m; "
            "assert 'triton' not in sys.modules, 'triton imported'; "
            "import torch; c = m.pack_int4(torch.zeros(2, 32, dtype=torch.uint8)); "
            "m.dequantize(c, torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.uint8), 32, 4, "
            "torch.float32); assert 'triton' not in sys.modules, 'triton imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
