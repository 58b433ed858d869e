"""The batching strategies, by the name serving.properties resolves to."""

from __future__ import annotations

import logging
from dataclasses import replace

from engine.config import EngineConfig
from engine.kv.budget import KVPlan, build_allocator
from engine.models.spec import ModelSpec
from engine.scheduler.base import ScheduledBatch, Scheduler
from engine.scheduler.continuous import ContinuousBatching
from engine.scheduler.dynamic import DynamicBatching
from engine.scheduler.no_batching import NoBatching
from engine.scheduler.paged import PagedBatching

SCHEDULERS: dict[str, type[Scheduler]] = {
    "none": NoBatching,
    "dynamic": DynamicBatching,
    "continuous": ContinuousBatching,
    "paged": PagedBatching,
}

logger = logging.getLogger(__name__)


def build_scheduler(config: EngineConfig, plan: KVPlan, spec: ModelSpec,
                    max_model_len: int) -> Scheduler:
    """The strategy's scheduler over its allocator. A LongRoPE model whose sequences may
    outgrow its original context recomputes a sequence that crosses it, and keeps no prefix
    cache: a cached block holds one rope mode's KV, which a longer prompt could not reuse."""
    after = spec.rope_long_after
    if after is not None and max_model_len <= after:
        after = None  # no sequence can cross
    if after is not None and config.enable_prefix_caching:
        logger.warning("prefix caching is off: %s rotates sequences longer than %d tokens "
                       "differently (LongRoPE), so their KV cannot be shared", spec.architecture,
                       after)
        config = replace(config, enable_prefix_caching=False)
    scheduler = SCHEDULERS[config.batching](config, build_allocator(config, plan))
    scheduler.long_rope_after = after
    return scheduler


__all__ = ["SCHEDULERS", "ScheduledBatch", "Scheduler", "build_scheduler"]
