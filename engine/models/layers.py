"""Llama-family building blocks shared by the model and the fused CPU ops: RMSNorm and RoPE."""

from __future__ import annotations

import math

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: computed in float32 and cast back, exactly as transformers does.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(config: dict, head_dim: int) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies for rope types default, linear and llama3."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / rope["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, rope)
    raise ValueError(f"rope type {kind!r} is not supported; supported: default, linear, llama3")


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: dict) -> torch.Tensor:
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, head_dim]; cos/sin [N, 1, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
