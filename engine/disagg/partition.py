"""KV-Runahead's partition rule (no torch: the router imports it).

A token costs `r` units of the layers' matrix products plus one unit per earlier position it
attends to, so positions 0..q-1 cost C(q) = r q + q^2 / 2, and slice i of k ends where C reaches
(i + 1) / k of C(n): later slices are shorter, since their tokens attend to more."""

from __future__ import annotations

import math
from typing import Any


def linear_tokens(config: dict[str, Any]) -> float:
    """r: a token's matrix-product FLOPs in units of attending to one position (4 * the query
    width per layer), from a Hugging Face config.json."""
    text = config.get("text_config", config)
    hidden = text["hidden_size"]
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or hidden // heads
    kv_heads = text.get("num_key_value_heads") or heads
    inter = text.get("intermediate_size") or 4 * hidden
    q, kv = heads * head_dim, kv_heads * head_dim
    linear = 2 * hidden * (q + 2 * kv) + 2 * q * hidden + 6 * hidden * inter  # per layer
    return linear / (4 * q)


def partition(num_tokens: int, num_workers: int, r: float) -> list[int]:
    """Where each slice starts (the first at 0): equal shares of C(q) = r q + q^2 / 2, each
    slice at least one token."""
    total = r * num_tokens + num_tokens ** 2 / 2
    starts = [0]
    for i in range(1, num_workers):
        target = total * i / num_workers
        q = round(-r + math.sqrt(r * r + 2 * target))  # C(q) = target
        starts.append(min(max(q, starts[-1] + 1), num_tokens - (num_workers - i)))
    return starts
