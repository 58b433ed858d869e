"""Linear layers over quantized weights, held at their quantized size on the device.

IntQuantLinear (AWQ, GPTQ, compressed-tensors W4A16/W8A16): uint8 codes (two 4-bit codes per
byte), float32 scales and uint8 zero points per group. On CUDA one Triton kernel
(engine/kernels/triton_wq.py) dequantizes tiles in registers inside the matmul; elsewhere, and
where that kernel disagrees at start-up, the layer dequantizes into a transient weight and calls
F.linear (exactly transformers' arithmetic on the dequantized checkpoint).

Fp8Linear (transformers fp8, compressed-tensors FP8, option.quantize=fp8): float8 e4m3 weights
and float32 scales per (row, column block). Activations are quantized as the checkpoint says
(per token, per group, or its static scale) and the matmul runs on torch._scaled_mm where the
GPU has FP8 (sm89+) and the scales are per row; elsewhere the same arithmetic is emulated:
quantize-dequantize the input, dequantize the weight, F.linear.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.triton_wq import pack_int4, unpack_int4
from engine.quant.scheme import FP8_MAX, ActQuant
from engine.quant.unpack import FloatWeights, IntWeights

logger = logging.getLogger(__name__)

# Largest |kernel - emulated| allowed at start-up, relative to the largest |emulated| output.
KERNEL_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}
# Largest |fp8 - float| allowed at start-up for option.quantize=fp8 (weights and inputs rounded
# to 3 mantissa bits), relative to the largest |float| output.
FP8_TOLERANCE = 1e-1
# Devices whose layers try the fast path (checked at start-up against the emulated one). The
# CPU keeps the emulated path, exactly transformers' arithmetic; tests add it to prove the
# fast paths on the CPU (Triton's interpreter, PyTorch's CPU _scaled_mm).
KERNEL_DEVICES = ("cuda",)
_warned: set[str] = set()


def _warn_once(key: str, message: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)


class IntQuantLinear(nn.Module):
    """y = x W^T + b, W[n, k] = (code - zero[n, g]) * scale[n, g]; x [..., K] → [..., N]."""

    codes: torch.Tensor  # buffers, declared for the type checker
    scales: torch.Tensor
    zeros: torch.Tensor

    def __init__(self, weights: IntWeights, bits: int, bias: torch.Tensor | None,
                 dtype: torch.dtype, device: torch.device, kernel: bool | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weights.codes.shape
        self.bits, self.group = bits, weights.group
        codes = weights.codes.to(device)
        self.packed = bits == 4 and self.in_features % 2 == 0
        if self.packed:  # column 2j in the low nibble of byte j, 2j + 1 in the high one
            codes = pack_int4(codes)  # [N, K / 2]
        self.register_buffer("codes", codes.contiguous())
        # NOTE: scales keep the checkpoint's dtype (float16 in AWQ/GPTQ): exact, and half the
        # bytes of float32; the arithmetic is float32
        self.register_buffer("scales", weights.scales.to(device).contiguous())
        self.register_buffer("zeros", weights.zeros.to(device).contiguous())
        self.g_idx: torch.Tensor | None
        self.register_buffer("g_idx", None if weights.g_idx is None
                             else weights.g_idx.to(device))
        self.bounds = weights.bounds  # g_idx [parts, K]: each part's rows
        self.bias = None if bias is None else nn.Parameter(bias.to(device, dtype),
                                                           requires_grad=False)
        self.kernel = self._kernel_agrees(dtype) if kernel is None else kernel

    def unpacked_codes(self) -> torch.Tensor:
        """[N, K] uint8."""
        return unpack_int4(self.codes) if self.packed else self.codes

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] in `dtype`, computed in float32: (code - zero) * scale."""
        codes = self.unpacked_codes().float()
        if self.g_idx is not None and self.bounds is not None:
            return torch.cat([_dequant_reordered(codes[a:b], self.zeros[a:b], self.scales[a:b],
                                                 g_idx, dtype)
                              for a, b, g_idx in zip(self.bounds[:-1], self.bounds[1:], self.g_idx,
                                                     strict=True)])
        if self.g_idx is not None:
            return _dequant_reordered(codes, self.zeros, self.scales, self.g_idx, dtype)
        n, groups = self.scales.shape
        grouped = codes.view(n, groups, -1)  # [N, groups, G]
        w = (grouped - self.zeros.float()[..., None]) * self.scales.float()[..., None]
        return w.view(n, -1).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [M, K]
        if self.kernel:
            from engine.kernels.triton_wq import wq_matmul
            y = wq_matmul(rows.contiguous(), self.codes, self.scales, self.zeros, self.group,
                          self.bits, self.bias)
        else:
            y = F.linear(rows, self.dequantized(rows.dtype), self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def _kernel_agrees(self, dtype: torch.dtype) -> bool:
        """The Triton kernel on CUDA for 4- and 8-bit codes in group order, when it matches the
        dequantizing path on a probe; a disagreement is logged and the layer dequantizes."""
        if (self.codes.device.type not in KERNEL_DEVICES or self.g_idx is not None
                or self.bits not in (4, 8) or not self.packed and self.bits == 4
                or self.group % 16):
            return False
        return _fast_path_agrees(self, "kernel", dtype, "int weight kernel",
                                 "dequantized weights", "dequantizing instead")


def _fast_path_agrees(layer: IntQuantLinear | Fp8Linear, flag: str, dtype: torch.dtype,
                      path: str, reference: str, instead: str) -> bool:
    """Whether `layer` with its fast path on (attribute `flag`) matches it off on a probe;
    a failure or a disagreement (NaN included) is logged once, and the flag left off. The
    bias is not read yet: the probe goes without it."""
    probe = torch.randn(5, layer.in_features, device=layer.scales.device, dtype=dtype)
    bias, layer.bias = layer.bias, None
    try:
        setattr(layer, flag, True)
        got = layer(probe).float()
        setattr(layer, flag, False)
        want = layer(probe).float()
    except Exception as err:  # noqa: BLE001 - any fast-path failure falls back, loudly
        _warn_once(f"{path} failed", f"{path} failed (%s); {instead}", err)
        return False
    finally:
        setattr(layer, flag, False)
        layer.bias = bias
    error = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    if not math.isfinite(error) or error > KERNEL_TOLERANCE.get(dtype, 2e-2):
        _warn_once(f"{path} differs", f"{path} differs from {reference} by %.1e (relative); "
                   f"{instead}", error)
        return False
    return True


def _dequant_reordered(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                       g_idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Act-order: input column k belongs to group g_idx[k]; codes [R, K] float → [R, K]."""
    return ((codes - zeros[:, g_idx].float()) * scales[:, g_idx].float()).to(dtype)


def quantize_activations(x: torch.Tensor, act: ActQuant,
                         input_scale: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] rounded through float8 e4m3 and back: x_q = fp8(x / s) * s, s = the static
    scale, or max |x| / 448 per row (token) or per `act.group` columns of a row (group)."""
    h = x.float()
    if act.kind == "static":
        assert input_scale is not None  # the loader refuses a static scheme without it
        scale = input_scale
    elif act.kind == "group":
        h = h.view(h.shape[0], -1, act.group)  # [M, K / g, g]
        scale = h.abs().amax(-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    else:
        scale = h.abs().amax(-1, keepdim=True).clamp_min(1e-12) / FP8_MAX  # [M, 1]
    q = (h / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).view(x.shape).to(x.dtype)


class Fp8Linear(nn.Module):
    """y = q(x) W^T + b, W[n, k] = w8[n, k] * scale[n, k // block]; x [..., K] → [..., N]."""

    weight: torch.Tensor  # buffers, declared for the type checker
    scales: torch.Tensor

    def __init__(self, weights: FloatWeights, act: ActQuant | None, bias: torch.Tensor | None,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.out_features, self.in_features = weights.weight.shape
        self.block, self.act = weights.block, act
        if act is not None and act.kind == "group" and self.in_features % act.group:
            raise ValueError(f"fp8 activations quantized in groups of {act.group} need input "
                             f"columns in whole groups; this layer has {self.in_features}")
        self.register_buffer("weight", weights.weight.to(device).contiguous())
        self.register_buffer("scales", weights.scales.to(device, torch.float32).contiguous())
        self.input_scale: torch.Tensor | None
        self.register_buffer("input_scale", None if weights.input_scale is None
                             else weights.input_scale.to(device, torch.float32))
        self.bounds = weights.bounds  # input_scale [parts]: each part's rows
        self.bias = None if bias is None else nn.Parameter(bias.to(device, dtype),
                                                           requires_grad=False)
        self.scaled_mm = self._scaled_mm_agrees(dtype)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Fp8Linear:
        """option.quantize=fp8: one scale per output row (max |w| / 448), activations per
        token, as vLLM's --quantization fp8 does."""
        w = weight.detach().float()
        scales = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / FP8_MAX  # [N, 1]
        w8 = (w / scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return cls(FloatWeights(w8, scales, w.shape[1]), ActQuant("token"),
                   None if bias is None else bias.detach(), weight.dtype, weight.device)

    def dequantized(self, dtype: torch.dtype, out: slice = slice(None)) -> torch.Tensor:
        """[N, K] (the rows `out`) in `dtype`, computed in float32."""
        scales = self.scales[out]
        if scales.shape[1] > 1:
            scales = scales.repeat_interleave(self.block, dim=1)[:, :self.in_features]
        return (self.weight[out].float() * scales).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [M, K]
        if self.bounds is None:
            y = self._part(rows, slice(None), self.input_scale)
        else:  # a fused layer whose parts keep their own static input scales
            assert self.input_scale is not None
            y = torch.cat([self._part(rows, slice(a, b), scale) for a, b, scale
                           in zip(self.bounds[:-1], self.bounds[1:], self.input_scale,
                                  strict=True)], dim=-1)
        return y.view(*x.shape[:-1], self.out_features)

    def _part(self, rows: torch.Tensor, out: slice, input_scale: torch.Tensor | None
              ) -> torch.Tensor:
        """rows [M, K] → [M, the output columns `out`]."""
        bias = None if self.bias is None else self.bias[out]
        if self.scaled_mm:
            return self._forward_scaled_mm(rows, out, input_scale, bias)
        if self.act is not None:
            rows = quantize_activations(rows, self.act, input_scale)
        return F.linear(rows, self.dequantized(rows.dtype, out), bias)

    def _forward_scaled_mm(self, rows: torch.Tensor, out: slice,
                           input_scale: torch.Tensor | None,
                           bias: torch.Tensor | None) -> torch.Tensor:
        """FP8 x FP8 on the tensor cores, float32 accumulation, scales applied per row."""
        h = rows.float()
        if self.act is not None and self.act.kind == "static":
            assert input_scale is not None
            scale = input_scale.reshape(1, 1).expand(h.shape[0], 1).contiguous()
        else:
            scale = h.abs().amax(-1, keepdim=True).clamp_min(1e-12) / FP8_MAX  # [M, 1]
        q = (h / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return torch._scaled_mm(q, self.weight[out].t(), scale_a=scale,
                                scale_b=self.scales[out].t().contiguous(), bias=bias,
                                out_dtype=rows.dtype)

    def _scaled_mm_agrees(self, dtype: torch.dtype) -> bool:
        """torch._scaled_mm where it serves this layer (CUDA sm89+, one scale per row,
        activations per token or static) and matches the emulated path on a probe."""
        device = self.weight.device
        if device.type not in KERNEL_DEVICES:
            return False
        if (self.scales.shape[1] != 1 or self.act is None or self.act.kind == "group"
                or device.type == "cuda" and (dtype == torch.float32 or
                                              torch.cuda.get_device_capability(device) < (8, 9))):
            _warn_once("fp8-emulated", "fp8 layers dequantize before each matmul (no "
                       "_scaled_mm for this GPU, dtype or scale layout)")
            return False
        return _fast_path_agrees(self, "scaled_mm", dtype, "torch._scaled_mm",
                                 "the emulated fp8 matmul", "fp8 layers dequantize")
