"""Linear layers on CPU through oneDNN, with each weight packed once at load.

PyTorch's CPU `F.linear` goes to the BLAS it was built with (MKL), which on some x86 CPUs
(AMD EPYC among them) picks a slow path: 2.5-4x slower than oneDNN on the decode shapes of a
small model. oneDNN with a pre-packed (blocked) weight is what inductor emits on CPU; here it is
called directly, without compiling the model. Results differ from MKL's only by float rounding
order (the start-up check bounds it).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

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
    return (device.type == "cpu" and dtype in TOLERANCE and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


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
    """Replace every nn.Linear in `model` by a PackedLinear checked against F.linear; returns
    how many were replaced. Raises ValueError (nothing replaced) when one disagrees."""
    found = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if type(child) is nn.Linear]
    packed = [PackedLinear(child.weight, child.bias, batch_hint) for _, _, child in found]
    for (_, name, child), new in zip(found, packed, strict=True):
        error = _relative_error(child, new)
        if error > TOLERANCE[child.weight.dtype]:
            raise ValueError(f"oneDNN linear {name} differs from aten by {error:.1e} (relative)")
    for (parent, name, _), new in zip(found, packed, strict=True):
        setattr(parent, name, new)
    return len(packed)


@torch.inference_mode()
def _relative_error(reference: nn.Linear, packed: PackedLinear) -> float:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, reference.in_features, generator=generator).to(reference.weight.dtype)
    want = F.linear(x, reference.weight, reference.bias).float()
    got = packed(x).float()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
