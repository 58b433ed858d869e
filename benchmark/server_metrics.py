"""What the server says about itself: /metrics before and after a run, as differences."""

from __future__ import annotations

from dataclasses import dataclass

import requests
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class ServerSnapshot:
    """Sample values by name (labels folded into the name as name{k=v})."""

    values: dict[str, float]

    def get(self, name: str) -> float:
        return self.values.get(name, 0.0)

    def delta(self, after: ServerSnapshot) -> dict[str, float]:
        """Per-step means over the run between this snapshot and `after`."""
        def diff(name: str) -> float:
            return after.get(name) - self.get(name)

        steps = diff("batchyard_batch_size_count")
        decode_steps = diff("batchyard_decode_batch_size_count")
        out = {
            "steps": steps,
            "mean_batch_size": diff("batchyard_batch_size_sum") / steps if steps else 0.0,
            "mean_decode_batch_size": (diff("batchyard_decode_batch_size_sum") / decode_steps
                                       if decode_steps else 0.0),
            "mean_step_s": diff("batchyard_step_seconds_sum") / steps if steps else 0.0,
            "mean_kv_usage": diff("batchyard_kv_cache_usage_ratio_sum") / steps if steps else 0.0,
            "prefill_tokens": diff('batchyard_step_tokens_total{kind="prefill"}'),
            "decode_tokens": diff('batchyard_step_tokens_total{kind="decode"}'),
            "preemptions": diff("batchyard_preemptions_total"),
        }
        for key in ("kv_max_concurrency", "kv_blocks_total", "kv_block_size"):
            if f"batchyard_{key}" in after.values:
                out[key] = after.get(f"batchyard_{key}")
        return out


def scrape(url: str, timeout: float = 5.0) -> ServerSnapshot:
    """GET `url` (a /metrics address) and flatten its samples."""
    text = requests.get(url, timeout=timeout).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items())
                              if k != "le")
            if "le" in sample.labels:
                continue  # histogram buckets: the sums and counts say enough here
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return ServerSnapshot(values)
