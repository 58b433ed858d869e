"""Paged batching: stall-free scheduling with chunked prefill (Sarathi-Serve) over paged KV."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from engine.config import EngineConfig
from engine.kv.block_manager import BlockManager
from engine.outputs import SampledToken
from engine.scheduler.base import ScheduledBatch, Scheduler
from engine.sequence import FinishReason, Sequence, SequenceStatus

logger = logging.getLogger(__name__)

DEFAULT_MAX_NUM_BATCHED_TOKENS = 512  # when option.max_rolling_batch_prefill_tokens is unset


class PagedBatching(Scheduler):
    """Each step: every running decode first, then partial prefills, then new requests.

    Prefill tokens share the step's token budget (`max_num_batched_tokens`); a prompt longer than
    what is left is prefilled in chunks over several steps, so decodes never stall behind it.
    When blocks run out, the youngest running sequence is preempted: its KV is freed and it is
    re-queued ahead of new arrivals, keeping its tokens to recompute.
    """

    allocator: BlockManager  # the paged pool: blocks on demand, prefix cache

    def __init__(self, config: EngineConfig, allocator: BlockManager,
                 now: Callable[[], float] = time.monotonic) -> None:
        super().__init__(config, allocator, now)
        # the step's token budget: the config's, else the paged default
        self.max_num_batched_tokens = (config.max_num_batched_tokens
                                       or DEFAULT_MAX_NUM_BATCHED_TOKENS)
        self.chunked = config.enable_chunked_prefill

    def _pick(self) -> ScheduledBatch | None:
        picked: dict[Sequence, int] = {}
        budget = self.max_num_batched_tokens
        preemptions_before = self.num_preemptions
        decodes, prefills = [], []
        for seq in self.running:
            if _is_decode(seq):
                decodes.append(seq)
            elif not seq.awaits_last_token:
                prefills.append(seq)
        # A preemption below may send a later one of these back to waiting: skipped then.
        for seq in decodes:
            if seq.status is SequenceStatus.RUNNING and self._reserve(seq, picked):
                picked[seq] = 1  # its proposals, if any, come last: from what is left
                budget -= 1
        for seq in prefills:
            if seq.status is not SequenceStatus.RUNNING:
                continue
            n = self._prefill_chunk(seq, budget, picked)
            if n:
                self.allocator.allocate(seq, n)
                picked[seq] = n
                budget -= n
        if self.num_preemptions == preemptions_before:  # admitting now would only thrash
            budget = self._admit_waiting(budget, picked)
        self._extend_with_proposals(budget, picked)
        if not picked:
            return None
        return ScheduledBatch(tuple(picked), tuple(picked.values()))

    def advance(self, batch: ScheduledBatch) -> None:
        super().advance(batch)
        allocator = self.allocator
        if not (allocator.enable_prefix_caching or allocator.any_window):
            return  # neither has work: spare a call per sequence per step
        for seq in batch.seqs:
            if not seq.is_finished:  # cached before a window lets them go: still reusable
                allocator.cache_full_blocks(seq)
                allocator.release_outside_window(seq)

    def resolve(self, batch: ScheduledBatch,
                samples: list[SampledToken | None]) -> list[Sequence]:
        finished = super().resolve(batch, samples)
        if self.allocator.enable_prefix_caching:
            for seq in batch.seqs:
                if not seq.is_finished:
                    self.allocator.cache_full_blocks(seq)
        return finished

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.allocator.cache_full_blocks(seq)  # its computed blocks outlive it in the cache
        super().finish(seq, reason)

    # --- policy pieces ---

    def _reserve(self, seq: Sequence, picked: dict[Sequence, int]) -> bool:
        """Give a running decode its next slot, preempting younger sequences if blocks run out."""
        if self.allocator.blocks_needed(seq, 1) == 0:  # 15 steps in 16 at block size 16
            return True
        if not self._make_room(seq, 1, picked):
            return False
        self.allocator.allocate(seq, 1)
        return True

    def _extend_with_proposals(self, budget: int, picked: dict[Sequence, int]) -> None:
        """Speculative proposals ride on what decodes, prefills and admissions left of the
        budget and of the free blocks, in decode order; the others are dropped (they never
        take a slot from a prompt, nor preempt anyone)."""
        for seq in picked:
            if not seq.num_drafts:
                continue
            n = seq.num_uncomputed_tokens  # 1 + its proposals
            if n - 1 <= budget and self.allocator.can_allocate(seq, n):
                self.allocator.allocate(seq, n)
                picked[seq] = n
                budget -= n - 1
            else:
                seq.withdraw_drafts()

    def _prefill_chunk(self, seq: Sequence, budget: int, picked: dict[Sequence, int]) -> int:
        """Prompt tokens of a running `seq` to compute now, preempting younger ones for room."""
        n = self._wanted_chunk(seq, budget, picked)
        if n == 0 or not self._make_room(seq, 1 if self.chunked else n, picked):
            return 0
        return min(n, self._free_slots(seq))

    def _wanted_chunk(self, seq: Sequence, budget: int, picked: dict[Sequence, int]) -> int:
        remaining = seq.num_uncomputed_tokens
        if self.chunked:
            return max(0, min(remaining, budget))
        # Unchunked: a whole prompt, and one long prompt may exceed the budget (it then stalls
        # the decodes of this step: the cost chunking removes).
        prefilling = any(n > 1 for n in picked.values())
        return remaining if remaining <= budget or not prefilling else 0

    def _make_room(self, seq: Sequence, tokens: int, picked: dict[Sequence, int]) -> bool:
        """Preempt the youngest unpicked sequences until `tokens` fit; False if `seq` went."""
        while self._free_slots(seq) < tokens:
            victims = [s for s in self.running if s not in picked and s is not seq]
            victim = victims[-1] if victims else seq
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _free_slots(self, seq: Sequence) -> int:
        """Token slots `seq` can still write: the rest of its own blocks plus the free ones."""
        return self.allocator.free_slots(seq)

    def _admit_waiting(self, budget: int, picked: dict[Sequence, int]) -> int:
        """Admit waiting sequences under `budget`; returns what is left of it."""
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if not self._adapter_fits(seq):
                break
            if seq.cooperative:  # one a step: its step trades K/V with one exchange
                if any(s.cooperative for s in picked) or not self._admit_prefilled(seq, picked):
                    break
                budget -= picked[seq]  # the whole slice in one step, past the budget
                continue
            if not (seq.num_remote_kv_tokens and self.allocator.any_window):
                self.allocator.match_prefix(seq)  # (placed KV skips windows' slid-past blocks)
            if seq.num_remote_kv_tokens > seq.num_computed_tokens:
                if not self._admit_prefilled(seq, picked):
                    break
                budget -= 1
                continue
            n = self._wanted_chunk(seq, budget, picked)
            n = n if self.chunked or n <= self._free_slots(seq) else 0
            n = min(n, self._free_slots(seq))
            if n == 0:
                self.allocator.free(seq)  # give back the prefix blocks it just shared
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            self.allocator.allocate(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            picked[seq] = n
            budget -= n
        return budget

    def _admit_prefilled(self, seq: Sequence, picked: dict[Sequence, int]) -> bool:
        """A sequence whose leading KV other workers compute (engine/disagg/): blocks for all
        its tokens, those counted as computed from `kv_import_start` on (the runner places
        them before the step); the rest is computed now, in one step: a decode's first output
        token, or a cooperative prompt slice. False (nothing taken) when the blocks are not
        free."""
        if self.allocator.any_window:  # nothing matched: blocks for what stays visible
            if not self.allocator.allocate_placed(seq, seq.num_tokens, seq.num_remote_kv_tokens):
                return False
        elif seq.num_uncomputed_tokens > self._free_slots(seq):
            self.allocator.free(seq)  # give back the prefix blocks it just shared
            seq.num_computed_tokens = 0
            return False
        else:
            self.allocator.allocate(seq, seq.num_uncomputed_tokens)
        self.waiting.popleft()
        seq.kv_import_start = seq.num_computed_tokens
        seq.num_computed_tokens = seq.num_remote_kv_tokens
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        picked[seq] = seq.num_uncomputed_tokens
        return True

    def _recompute(self, seq: Sequence) -> None:
        self._preempt(seq)  # its blocks may be shared or freed behind a window: start afresh

    def _preempt(self, seq: Sequence) -> None:
        seq.withdraw_drafts()
        self.running.remove(seq)
        self.allocator.cache_full_blocks(seq)
        self.allocator.free(seq)
        seq.num_computed_tokens = 0
        seq.num_remote_kv_tokens = 0  # its KV went with its blocks: recomputed from here
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        logger.debug("preempted sequence %d (%d tokens) to recompute later", seq.seq_id,
                     seq.num_tokens)

    @property
    def block_size(self) -> int:
        return self.allocator.block_size


def _is_decode(seq: Sequence) -> bool:
    return (seq.num_output_tokens > 0 and seq.num_uncomputed_tokens == 1 + seq.num_drafts
            and not seq.awaits_last_token)
