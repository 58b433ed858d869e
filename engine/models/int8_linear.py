"""Weight-only int8 (option.quantize=int8): each nn.Linear keeps int8 weights with one scale per
output channel (symmetric, round to nearest); activations stay in the model's dtype. Weights
take a quarter of their float32 memory (half of bf16); outputs differ from the float layer by
the rounding of the weights (checked against it at start-up)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Largest |int8 - float| allowed, relative to the largest |float| output, at start-up (the
# default model's o_proj rounds to 4.8e-2 on the random probe: 3e-2 refused it).
INT8_TOLERANCE = 6e-2


class Int8Linear(nn.Module):
    """y = (x Q^T) * s + b; Q [out, in] int8, s [out] in the input dtype."""

    qweight: torch.Tensor  # buffers (register_buffer), declared for the type checker
    scales: torch.Tensor

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        w = weight.detach()
        self.out_features, self.in_features = w.shape
        scales = w.float().abs().amax(dim=1).clamp_min(1e-12) / 127  # [out]
        self.register_buffer("qweight", (w.float() / scales[:, None]).round()
                             .clamp(-127, 127).to(torch.int8))  # [out, in]
        self.register_buffer("scales", scales.to(w.dtype))
        self.bias = None if bias is None else bias.detach()
        self.kernel = _kernel_runs(self.qweight, self.scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()  # [N, in]
        # PyTorch's fused int8-weight matmul (CPU, and CUDA where built); on the CPU its time
        # grows with the rows (1536 x 576 on 2 Xeon cores: 0.29 ms at 1 row, 8.4 ms at 32,
        # where dequantizing then F.linear takes 0.24-0.52 ms): there it serves one row only
        if self.kernel and (rows.shape[0] == 1 or rows.device.type != "cpu"):
            y = torch._weight_int8pack_mm(rows, self.qweight, self.scales)
        else:  # dequantize on the fly: correct everywhere, no faster than the float layer
            y = F.linear(rows, self.qweight.to(rows.dtype)) * self.scales
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def _kernel_runs(qweight: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether PyTorch's fused int8-weight matmul runs for this layer's device, dtype and
    shape: it is not built for all of them, and says so by raising. When it does not, forward()
    dequantizes instead (same result, checked at start-up), so a user never meets the error."""
    probe = torch.zeros(1, qweight.shape[1], dtype=scales.dtype, device=qweight.device)
    try:
        torch._weight_int8pack_mm(probe, qweight, scales)
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return True
