"""Linear layers on CPU with each weight packed once at load: our tiled kernel or oneDNN.

PyTorch's CPU `F.linear` goes to the BLAS it was built with (MKL), which on some x86 CPUs
(AMD EPYC among them) picks a slow path: 2.5-4x slower than oneDNN on the decode shapes of a
small model. oneDNN, in turn, does not overlap the weight stream with the arithmetic at decode
sizes; engine/kernels/gemm.c does (float32 only; its header gives the figures). Both replace
nn.Linear without compiling the model; results differ from MKL's only by float rounding order
(each shape is checked at start-up).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import LINEAR_BACKENDS, EngineConfig
from engine.kernels import load_kernels
from engine.models.int8_linear import INT8_TOLERANCE, Int8Linear
from engine.models.registry import native_names
from engine.quant.linear import FP8_TOLERANCE, Fp8Linear

logger = logging.getLogger(__name__)

# oneDNN's packed weights are blocked for a batch of this many rows; any batch runs.
DECODE_BATCH_HINT = 32
# Largest |packed - aten| allowed, relative to the largest |aten| output, at start-up.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
GEMM_TILE = 16  # output columns per tile in engine/kernels/gemm.c


class PacksLinears(Protocol):
    """A model that packs its own matmuls (the native models, the transformers fallback)."""

    def pack_linears(self, backend: str, batch_hint: int) -> int: ...


class TiledLinear(nn.Module):
    """y = x W^T + b through engine/kernels/gemm.c; x [N, in] → y [N, out], float32 on CPU."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.lib = load_kernels()
        self.out_features, self.in_features = weight.shape
        tiles = -(-self.out_features // GEMM_TILE)
        # NOTE: a plain attribute, not a parameter: [tiles, in, 16] has no nn.Linear layout.
        self.tiles = torch.empty(tiles * self.in_features * GEMM_TILE)
        weight = weight.detach().float().contiguous()
        self.lib.batchyard_gemm_pack(weight.data_ptr(), self.out_features, self.in_features,
                                     self.tiles.data_ptr())
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()  # [N, in]
        if rows.dtype != torch.float32:
            raise TypeError(f"TiledLinear computes float32, got {rows.dtype}")
        y = torch.empty(rows.shape[0], self.out_features)  # [N, out]
        self.lib.batchyard_gemm(rows.data_ptr(), self.tiles.data_ptr(),
                                None if self.bias is None else self.bias.data_ptr(), y.data_ptr(),
                                rows.shape[0], self.out_features, self.in_features,
                                torch.get_num_threads())
        return y.view(*x.shape[:-1], self.out_features)


class PackedLinear(nn.Module):
    """y = x W^T + b with W in oneDNN's blocked layout; x [N, in] → y [N, out]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        # NOTE: plain attributes, not parameters: a blocked tensor has no strides to save or move.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none",
                                                  [], "")


def onednn_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN on this CPU for this dtype (bf16 needs AVX-512 BW or AVX-NE-CONVERT)."""
    if device.type != "cpu" or dtype not in TOLERANCE or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def linear_candidates(name: str, device: torch.device, dtype: torch.dtype) -> list[str]:
    """The packed backends `linear_backend=name` tries, in order ([]: aten's nn.Linear);
    ValueError when a backend asked for by name cannot run on this device and dtype."""
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"invalid linear_backend={name!r}: must be one of "
                         f"{', '.join(LINEAR_BACKENDS)}")
    tiled = device.type == "cpu" and dtype == torch.float32
    if name == "tiled" and not tiled:
        raise ValueError(f"invalid linear_backend='tiled': needs a CPU and float32, not "
                         f"{device.type}/{dtype}")
    if name == "onednn" and not onednn_supported(device, dtype):
        raise ValueError(f"invalid linear_backend='onednn': needs a CPU with oneDNN and "
                         f"float32 or bfloat16, not {device.type}/{dtype}")
    if name != "auto":
        return [] if name == "aten" else [name]
    return [b for b, ok in (("tiled", tiled), ("onednn", onednn_supported(device, dtype))) if ok]


def linear_factory(backend: str, batch_hint: int = DECODE_BATCH_HINT
                   ) -> Callable[[torch.Tensor, torch.Tensor | None], nn.Module]:
    """(weight, bias) → the packed layer of `backend` ("tiled", "onednn", or "int8" / "fp8":
    the layers option.quantize quantizes at load)."""
    if backend == "tiled":
        return TiledLinear
    if backend == "int8":
        return Int8Linear
    if backend == "fp8":
        return Fp8Linear.from_float
    return lambda weight, bias: PackedLinear(weight, bias, batch_hint)


def pack_linears(model: nn.Module, backend: str = "onednn",
                 batch_hint: int = DECODE_BATCH_HINT, keep: tuple[str, ...] = ()) -> int:
    """Replace every nn.Linear in `model` (but its children named in `keep`) by `backend`'s
    packed layer; returns how many.

    One layer of each shape is first checked against F.linear: ValueError (nothing replaced)
    when it disagrees. Layers are then swapped one at a time, so only one weight is held twice.
    """
    make = linear_factory(backend, batch_hint)
    # (parent, attribute) only: holding the layers themselves would keep every old weight alive
    found = [(parent, name) for parent in model.modules()
             for name, child in parent.named_children() if type(child) is nn.Linear
             and not (parent is model and name in keep)]
    checked: set[tuple] = set()
    for parent, name in found:
        child = getattr(parent, name)
        key = (tuple(child.weight.shape), child.weight.dtype, child.bias is not None)
        if key not in checked:
            packed_checked(make, child.weight, child.bias, name)
            checked.add(key)
    for parent, name in found:
        child = getattr(parent, name)
        setattr(parent, name, make(child.weight, child.bias))
    return len(found)


def packed_checked(make: Callable[[torch.Tensor, torch.Tensor | None], nn.Module],
                   weight: torch.Tensor, bias: torch.Tensor | None, name: str) -> nn.Module:
    """make(weight, bias) when it agrees with F.linear, or ValueError naming `name`."""
    packed = make(weight, bias)
    error = _relative_error(weight, bias, packed)
    limit = TOLERANCE.get(weight.dtype, INT8_TOLERANCE)
    if make is Int8Linear:  # the weights are rounded to 8 bits on purpose
        limit = max(limit, INT8_TOLERANCE)
    if make == Fp8Linear.from_float:  # weights and inputs rounded to float8 on purpose
        limit = max(limit, FP8_TOLERANCE)
    if error > limit:
        raise ValueError(f"packed linear {name} differs from aten by {error:.1e} (relative)")
    return packed


@torch.inference_mode()
def _relative_error(weight: torch.Tensor, bias: torch.Tensor | None, packed: nn.Module) -> float:
    """On 3 and 13 rows: the tiled kernel handles rows in passes of up to 6 (13 = 5 + 4 + 4)."""
    generator = torch.Generator().manual_seed(0)
    worst = 0.0
    for rows in (3, 13):
        x = torch.randn(rows, weight.shape[1], generator=generator).to(weight.device,
                                                                      weight.dtype)
        want = F.linear(x, weight, bias).float()
        got = packed(x).float()
        error = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
        worst = max(worst, error)
    return worst


def pack_model_linears(model: nn.Module, config: EngineConfig, device: torch.device,
                       dtype: torch.dtype) -> None:
    """Packed CPU matmuls: `auto` tries the tiled kernel, then oneDNN, then keeps aten; a
    backend asked for by name that fails or disagrees at start-up stops it. With
    quantize=int8 or fp8 every layer is quantized instead, on any device (a pre-quantized
    checkpoint is served as it is: its float layers, lm_head among them, are packed)."""
    # duck-typed: a model without pack_linears is refused (int8) or fails every backend
    packable = cast(PacksLinears, model)
    if config.quantize in ("int8", "fp8") and getattr(model, "quantization", None) is None:
        _quantize_at_load(packable, config.quantize, config.max_num_seqs)
        return
    candidates = linear_candidates(config.linear_backend, device, dtype)
    for backend in candidates:
        try:
            count = packable.pack_linears(backend, min(config.max_num_seqs, 64))
        except Exception as err:  # noqa: BLE001 - a kernel that fails or disagrees: next one
            if config.linear_backend == backend:
                raise ValueError(f"invalid linear_backend={backend!r}: {err}") from err
            logger.warning("linear_backend auto: %s failed (%s); trying the next", backend, err)
            continue
        logger.info("linear backend: %s, %d packed weights", backend, count)
        return
    if candidates:
        logger.warning("linear_backend auto: no packed backend agreed; using aten matmuls")


def _quantize_at_load(model: PacksLinears, quantize: str, max_num_seqs: int) -> None:
    """option.quantize=int8|fp8 on float weights: every linear layer quantized (int8: lm_head
    too; fp8 keeps it, and a tied one stays the embedding's, in full precision)."""
    if not hasattr(model, "pack_linears"):
        raise ValueError(f"invalid quantize={quantize!r}: needs a native model without sparse "
                         f"experts ({native_names(dense_only=True)})")
    count = model.pack_linears(quantize, min(max_num_seqs, 64))
    if quantize == "fp8":
        mm = sum(1 for m in cast(nn.Module, model).modules()
                 if isinstance(m, Fp8Linear) and m.scaled_mm)
        logger.info("weights quantized to fp8 e4m3 (one scale per output channel, activations "
                    "per token): %d layers, %d on torch._scaled_mm, %d emulated (dequantized "
                    "per step); linear_backend is not used", count, mm, count - mm)
        return
    fused = sum(1 for m in cast(nn.Module, model).modules()
                if isinstance(m, Int8Linear) and m.kernel)
    logger.info("weights quantized to int8 (weight-only, per output channel): %d layers, "
                "%d on PyTorch's fused int8 matmul, %d dequantized per step (no fused kernel "
                "for this device, dtype or shape); linear_backend is not used",
                count, fused, count - fused)
