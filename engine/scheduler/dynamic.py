"""Dynamic batching: gather up to batch_size requests or wait max_batch_delay, run to completion."""

from __future__ import annotations

from engine.scheduler.base import ScheduledBatch, Scheduler


class DynamicBatching(Scheduler):
    """Request-level batching (LMI `batch_size` + `max_batch_delay`): nobody joins a running batch.

    A batch starts when `max_num_seqs` requests wait or the oldest has waited `max_batch_delay_ms`;
    finished members leave early, but new requests wait until the whole batch is done.
    """

    def _pick(self) -> ScheduledBatch | None:
        if not self.running and self._batch_is_due():
            self._admit(max_running=self.config.max_num_seqs)
        return self._run_to_catch_up(self.running)

    def wait_hint(self) -> float | None:
        if self.running or not self.waiting:
            return None
        return max(0.0, self._due_time() - self.now())

    def _batch_is_due(self) -> bool:
        if len(self.waiting) >= self.config.max_num_seqs:
            return True
        return bool(self.waiting) and self.now() >= self._due_time()

    def _due_time(self) -> float:
        return self.waiting[0].arrival_time + self.config.max_batch_delay_ms / 1000.0
