"""No batching: one request at a time, run to completion."""

from __future__ import annotations

from engine.scheduler.base import ScheduledBatch, Scheduler


class NoBatching(Scheduler):
    """Admits the oldest waiting sequence only when nothing runs."""

    def _pick(self) -> ScheduledBatch | None:
        if not self.running:
            self._admit(max_running=1)
        return self._run_to_catch_up(self.running)
