"""Linear layers on CPU through oneDNN, with each weight packed once at load.

PyTorch's CPU `F.linear` goes to the BLAS it was built with (MKL), which on some x86 CPUs
(AMD EPYC among them) picks a slow path: 2.5-4x slower than oneDNN on the decode shapes of a
small model. PyTorch exposes oneDNN's linear with a pre-packed (blocked) weight as
torch.ops.mkldnn ops; they are called directly here, without compiling the model. Results
differ from MKL's only by float rounding order (the start-up check bounds it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

LINEAR_BACKENDS = ("auto", "onednn", "aten")
# Packed weights are blocked for a batch of this many rows; any batch runs, this one fastest.
DECODE_BATCH_HINT = 32
# Largest |oneDNN - aten| allowed, relative to the largest |aten| output, at start-up.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


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


def use_onednn(name: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `linear_backend=name` packs the model's linears; ValueError if it cannot."""
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"invalid linear_backend={name!r}: must be one of "
                         f"{', '.join(LINEAR_BACKENDS)}")
    if name == "onednn" and not onednn_supported(device, dtype):
        raise ValueError(f"invalid linear_backend='onednn': needs a CPU with oneDNN and "
                         f"float32 or bfloat16, not {device.type}/{dtype}")
    return name == "onednn" or (name == "auto" and onednn_supported(device, dtype))


def pack_linears(model: nn.Module, batch_hint: int = DECODE_BATCH_HINT) -> int:
    """Replace every nn.Linear in `model` by a PackedLinear; returns how many were replaced.

    One layer of each shape is first checked against F.linear: ValueError (nothing replaced)
    when it disagrees. Layers are then swapped one at a time, so only one weight is held twice.
    """
    # (parent, attribute) only: holding the layers themselves would keep every old weight alive
    found = [(parent, name) for parent in model.modules()
             for name, child in parent.named_children() if type(child) is nn.Linear]
    checked: set[tuple] = set()
    for parent, name in found:
        child = getattr(parent, name)
        key = (tuple(child.weight.shape), child.weight.dtype, child.bias is not None)
        if key not in checked:
            packed_checked(child.weight, child.bias, batch_hint, name)
            checked.add(key)
    for parent, name in found:
        child = getattr(parent, name)
        setattr(parent, name, PackedLinear(child.weight, child.bias, batch_hint))
    return len(found)


def packed_checked(weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int,
                   name: str) -> PackedLinear:
    """A PackedLinear of `weight` that agrees with F.linear, or ValueError naming `name`."""
    packed = PackedLinear(weight, bias, batch_hint)
    error = _relative_error(weight, bias, packed)
    if error > TOLERANCE[weight.dtype]:
        raise ValueError(f"oneDNN linear {name} differs from aten by {error:.1e} (relative)")
    return packed


@torch.inference_mode()
def _relative_error(weight: torch.Tensor, bias: torch.Tensor | None,
                    packed: PackedLinear) -> float:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, weight.shape[1], generator=generator).to(weight.dtype)
    want = F.linear(x, weight, bias).float()
    got = packed(x).float()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
