"""Choosing the attention backend: the reference everywhere, a fast kernel where one fits."""

from __future__ import annotations

import logging

import torch

from engine.attention.cpu import CpuPagedAttention
from engine.attention.reference import AttentionBackend, ReferenceAttention
from engine.attention.triton_paged import TritonPagedAttention
from engine.config import ATTENTION_BACKENDS
from engine.kernels import compiler
from engine.kernels.triton_setup import TritonUnavailable, import_triton

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


def _triton_available(device: torch.device) -> bool:
    try:
        import_triton(device)
    except TritonUnavailable as err:
        logger.info("Triton attention unavailable: %s", err)
        return False
    return True


def select_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto`: the fastest backend that runs on `device`; otherwise the one named.

    On CUDA `auto` picks `triton` (one paged kernel for every step, reading the pool in
    place), else `flex`. `triton` runs on the CPU too, through Triton's interpreter: slowly,
    for tests. On CPU `auto` picks `cpu_paged` (decode reads the pool in place) when a C
    compiler is there to build it; `flex` runs on any device, but on CPU its first call per
    shape compiles for many seconds. A backend that then fails its start-up check falls back
    (fallback_backend) under `auto`, and stops the start under its own name."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"invalid attention_backend={name!r}: must be one of "
                         f"{', '.join(ATTENTION_BACKENDS)}")
    if name == "triton" or (name == "auto" and device.type == "cuda"
                            and _triton_available(device)):
        try:
            backend: AttentionBackend = TritonPagedAttention(device)
        except TritonUnavailable as err:
            raise ValueError(f"invalid attention_backend='triton': {err}") from err
    elif name == "flex" or (name == "auto" and device.type == "cuda" and _flex_available()):
        backend = _flex(device)
    elif name == "cpu_paged" or (name == "auto" and device.type == "cpu" and compiler()):
        if device.type != "cpu":
            raise ValueError(f"invalid attention_backend='cpu_paged': runs on the CPU, "
                             f"not {device.type}")
        backend = CpuPagedAttention()
    else:
        backend = ReferenceAttention()
    logger.info("attention backend: %s on %s (asked for %s)", backend.name, device, name)
    return backend


def fallback_backend(failed: AttentionBackend, device: torch.device) -> AttentionBackend:
    """What `auto` uses when `failed` fails its start-up check: flex after triton on CUDA,
    the reference otherwise."""
    if failed.name == "triton" and device.type == "cuda" and _flex_available():
        return _flex(device)
    return ReferenceAttention()


def _flex(device: torch.device) -> AttentionBackend:
    from engine.attention.flex import FlexAttention

    return FlexAttention(device)
