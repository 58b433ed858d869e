"""Choosing the attention backend: the reference everywhere, a fast kernel where one fits."""

from __future__ import annotations

import logging

import torch

from engine.attention.cpu import CpuPagedAttention
from engine.attention.reference import AttentionBackend, ReferenceAttention
from engine.config import ATTENTION_BACKENDS
from engine.kernels import compiler

logger = logging.getLogger(__name__)

# flash-attn is not wired in yet. Its paged path (flash_attn_with_kvcache with block_table) needs
# page_block_size % 256 == 0 in upstream flash-attn 2 (docstring; Dao-AILab/flash-attention#828),
# so it would only fit block_size multiples of 256 (vLLM, on its own fork, needs multiples of 16).


def _flex_available() -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def select_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto`: the fastest backend that runs on `device`; otherwise the one named.

    `flex` runs on any device; on CPU its first call per shape compiles for many seconds, so
    `auto` picks it only on CUDA, where FlexAttention generates Triton kernels. On CPU `auto`
    picks `cpu_paged` (decode reads the pool in place) when a C compiler is there to build it;
    a backend that then fails its start-up check falls back to the reference."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"invalid attention_backend={name!r}: must be one of "
                         f"{', '.join(ATTENTION_BACKENDS)}")
    if name == "flex" or (name == "auto" and device.type == "cuda" and _flex_available()):
        from engine.attention.flex import FlexAttention

        backend: AttentionBackend = FlexAttention(device)
    elif name == "cpu_paged" or (name == "auto" and device.type == "cpu" and compiler()):
        if device.type != "cpu":
            raise ValueError(f"invalid attention_backend='cpu_paged': runs on the CPU, "
                             f"not {device.type}")
        backend = CpuPagedAttention()
    else:
        backend = ReferenceAttention()
    logger.info("attention backend: %s on %s (asked for %s)", backend.name, device, name)
    return backend
