"""The batching strategies, by the name serving.properties resolves to."""

from __future__ import annotations

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

__all__ = ["SCHEDULERS", "ScheduledBatch", "Scheduler"]
