"""Continuous (rolling) batching: retire and admit at every iteration."""

from __future__ import annotations

from engine.scheduler.base import ScheduledBatch, Scheduler


class ContinuousBatching(Scheduler):
    """Iteration-level batching over contiguous KV (LMI `rolling_batch=scheduler`).

    Every step admits waiting requests up to `max_num_seqs`; their whole prompts run in the same
    step as the decodes of the running ones. `max_num_batched_tokens`, when set, caps the prompt
    tokens admitted per step (at least one request is always admitted when a slot is free).
    """

    def _pick(self) -> ScheduledBatch | None:
        budget = self.config.max_num_batched_tokens
        if budget is None:
            self._admit(max_running=self.config.max_num_seqs)
        else:
            self._admit_within(budget)
        return self._run_to_catch_up(self.running)

    def _admit_within(self, budget: int) -> None:
        spent = 0
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            need = self.waiting[0].num_uncomputed_tokens
            if spent and spent + need > budget:
                return
            before = len(self.running)
            self._admit(max_running=before + 1)
            if len(self.running) == before:
                return
            spent += need
