"""Llama-family building blocks shared by the model and the fused CPU ops: RMSNorm and RoPE."""

from __future__ import annotations

import math
from typing import cast

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


ROPE_TYPES = ("default", "linear", "llama3", "longrope")  # what rope_tables computes


def rope_parameters(config: dict) -> dict:
    """The RoPE settings (transformers 5's `rope_parameters`, or the older `rope_scaling`)."""
    return config.get("rope_parameters") or config.get("rope_scaling") or {}


def rotary_dim(config: dict, head_dim: int) -> int:
    """How many leading dimensions of each head RoPE rotates (Phi-4-mini: 3/4 of them)."""
    factor = rope_parameters(config).get("partial_rotary_factor",
                                         config.get("partial_rotary_factor", 1.0))
    return int(head_dim * factor)


def rope_tables(config: dict, head_dim: int, max_positions: int,
                device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [P, rotary_dim] float32, P = max_positions; for LongRoPE (Phi-3) [2P, R]: rows
    P + p rotate position p with the long factors (the rows of a sequence longer than
    `long_rope_after`), rows p with the short ones; both scaled by its attention factor."""
    dim = rotary_dim(config, head_dim)
    positions = torch.arange(max_positions, dtype=torch.float32, device=device)  # [P]
    if rope_type(config) == "longrope":
        short, long, scale = _longrope(config, dim)
        freqs = torch.cat([torch.outer(positions, short.to(device)),
                           torch.outer(positions, long.to(device))])  # [2P, dim / 2]
    else:
        freqs, scale = torch.outer(positions, rope_inv_freq(config, dim).to(device)), 1.0
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos() * scale, emb.sin() * scale


def long_rope_after(config: dict) -> int | None:
    """LongRoPE's original context: longer sequences use the long factors (None: not LongRoPE)."""
    if rope_type(config) != "longrope":
        return None
    return rope_parameters(config).get("original_max_position_embeddings",
                                       config.get("original_max_position_embeddings"))


def rope_type(config: dict) -> str:
    rope = rope_parameters(config)
    return rope.get("rope_type", rope.get("type", "default"))


def _theta(config: dict) -> float:
    return rope_parameters(config).get("rope_theta", config.get("rope_theta", 10000.0))


def rope_inv_freq(config: dict, dim: int) -> torch.Tensor:
    """[dim / 2] float32 inverse frequencies for rope types default, linear and llama3."""
    rope, kind = rope_parameters(config), rope_type(config)
    inv_freq = 1.0 / (_theta(config) ** (torch.arange(0, dim, 2, dtype=torch.int64).float()
                                         / dim))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / rope["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, rope)
    raise ValueError(f"rope type {kind!r} is not supported; supported: default, linear, llama3, "
                     "longrope")


def _longrope(config: dict, dim: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(short inv_freq, long inv_freq, attention factor), as transformers computes them."""
    rope = rope_parameters(config)
    original = long_rope_after(config)
    factor = rope.get("factor") or config["max_position_embeddings"] / original
    scale = rope.get("attention_factor")
    if scale is None:
        # original is None only without original_max_position_embeddings (a TypeError then)
        scale = 1.0 if factor <= 1.0 else math.sqrt(
            1 + math.log(factor) / math.log(cast(int, original)))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    base = _theta(config) ** shape
    short = 1.0 / (torch.tensor(rope["short_factor"], dtype=torch.float32) * base)
    long = 1.0 / (torch.tensor(rope["long_factor"], dtype=torch.float32) * base)
    return short, long, scale


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
