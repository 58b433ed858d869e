"""Scheduler interface and the batch it returns. Pure Python: no torch here."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.kv.allocator import KVAllocator
from engine.outputs import SampledToken
from engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledBatch:
    """One step's work: each sequence and how many of its uncomputed tokens run now."""

    seqs: tuple[Sequence, ...]
    num_scheduled_tokens: tuple[int, ...]
    # Counted as planned: once the step runs, its sequences have moved on (a prompt's last
    # token then looks like a decode).
    num_decode_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        assert self.seqs and len(self.seqs) == len(self.num_scheduled_tokens)
        decodes = 0
        for seq, n in zip(self.seqs, self.num_scheduled_tokens, strict=True):
            left = len(seq.token_ids) - seq.num_computed_tokens
            assert 0 < n <= left, f"{seq}: {n} tokens scheduled, {left} uncomputed"
            # one token past the prompt that catches the sequence up (with the proposals after
            # it, speculating): a decode
            if n == 1 + seq.num_drafts == left and (
                    seq.num_computed_tokens >= seq.num_prompt_tokens):
                decodes += n
        object.__setattr__(self, "num_decode_tokens", decodes)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def is_sampled(self, i: int) -> bool:
        """Whether sequence i catches up this step, so the runner samples its next token."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_scheduled_tokens[i] == seq.num_tokens

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens


class Scheduler(ABC):
    """Admission policy over one allocator. Subclasses implement _pick() only."""

    def __init__(self, config: EngineConfig, allocator: KVAllocator,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.allocator = allocator
        self.now = now
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # LongRoPE models: sequences longer than this attend with the long factors, so one that
        # grows past it recomputes its KV (the engine sets it from the model; None: never).
        self.long_rope_after: int | None = None

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (FIFO)."""
        assert seq.status is SequenceStatus.WAITING and not seq.block_table
        seq.arrival_time = self.now()
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch | None:
        """The next step's batch, or None when nothing can run now."""
        if self.long_rope_after is None:
            return self._pick()
        for seq in list(self.running):  # crossed: its short-rotated KV is recomputed
            if (not seq.long_rope and seq.num_tokens > self.long_rope_after
                    and not seq.awaits_last_token):  # (it would only be dropped)
                seq.long_rope = True
                if seq.num_computed_tokens:
                    self._recompute(seq)
        batch = self._pick()
        # unchanged for those running; the newly admitted have computed nothing yet
        for seq in batch.seqs if batch else ():
            seq.long_rope = seq.num_tokens > self.long_rope_after
        return batch

    @abstractmethod
    def _pick(self) -> ScheduledBatch | None:
        """The policy: which sequences run which tokens in the next step."""

    def _recompute(self, seq: Sequence) -> None:
        """Compute a running sequence's KV again from its first token (in place: contiguous
        KV keeps its slot)."""
        seq.withdraw_drafts()
        seq.num_computed_tokens = 0

    def postprocess(self, batch: ScheduledBatch,
                    samples: list[SampledToken | None]) -> list[Sequence]:
        """Advance each sequence by its scheduled tokens, append sampled ones, retire finished.

        Returns the sequences that finished in this step.
        """
        self.advance(batch)
        return self.resolve(batch, samples)

    def advance(self, batch: ScheduledBatch) -> None:
        """The batch is computing: its tokens count as computed, and each sequence it catches up
        holds a pending place for the token being sampled. Under asynchronous scheduling the
        next step is planned from here, before that token is known."""
        for seq, n in zip(batch.seqs, batch.num_scheduled_tokens, strict=True):
            if seq.is_finished:  # finished by the caller between schedule() and now
                continue
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:  # caught up: its next token is sampled
                seq.append_pending()

    def resolve(self, batch: ScheduledBatch,
                samples: list[SampledToken | None]) -> list[Sequence]:
        """The batch's sampled tokens arrived: fill in the pending places and retire the
        sequences they end (their tokens computed ahead since are dropped). Returns those."""
        finished = []
        for seq, sample in zip(batch.seqs, samples, strict=True):
            if seq.is_finished or sample is None:
                continue
            seq.resolve_token(sample.token_id)
            reason = seq.token_finish_reason()
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def take_speculated(self, seq: Sequence, tokens: list[int]) -> int:
        """A verifying step's yield for `seq` (engine/spec/): its proposals settle, then
        `tokens` are appended in order, each but the last with its KV already computed (it was
        a proposal), until one ends the sequence. Returns how many it took."""
        seq.settle_drafts()
        for taken, token in enumerate(tokens, start=1):
            if taken > 1:  # the previous token was an accepted proposal: its KV exists
                seq.num_computed_tokens += 1
            seq.append_token(token)
            reason = seq.token_finish_reason()
            if reason is not None:
                self.finish(seq, reason)
                return taken
        return len(tokens)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End `seq` now (stop string, abort, timeout, error) and free its KV."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.allocator.free(seq)
        seq.finish(reason)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def wait_hint(self) -> float | None:
        """Seconds until schedule() may return a batch with no new input; None: only input helps."""
        return None

    def check_integrity(self) -> None:
        """Raise AssertionError if queues, statuses or KV ownership disagree."""
        ids = [s.seq_id for s in self.waiting] + [s.seq_id for s in self.running]
        assert len(ids) == len(set(ids)), "a sequence is queued twice"
        assert all(s.status is SequenceStatus.WAITING for s in self.waiting)
        assert all(s.status is SequenceStatus.RUNNING for s in self.running)
        assert len(self.running) <= self.config.max_num_seqs, "more running than max_num_seqs"
        self.allocator.check_integrity([*self.waiting, *self.running])

    # --- helpers shared by the policies ---

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Whether `seq` may run beside the running sequences: at most max_loras distinct LoRA
        adapters run at once (the device has that many slots). FIFO: one that must wait holds
        the queue, so none waits for ever."""
        if seq.lora_key is None:
            return True
        running = {s.lora_key for s in self.running if s.lora_key is not None}
        return seq.lora_key in running or len(running) < self.config.max_loras

    def _admit(self, max_running: int) -> None:
        """Move waiting sequences to running, FIFO, while slots, KV and adapter slots allow."""
        while self.waiting and len(self.running) < max_running:
            seq = self.waiting[0]
            if not self._adapter_fits(seq) or not self.allocator.can_allocate(
                    seq, seq.num_uncomputed_tokens):
                break
            self.waiting.popleft()
            self.allocator.allocate(seq, seq.num_uncomputed_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)

    def _run_to_catch_up(self, seqs: list[Sequence]) -> ScheduledBatch | None:
        """Schedule every uncomputed token of each sequence (prompt or last sampled token)."""
        seqs = [seq for seq in seqs if not seq.awaits_last_token]
        if not seqs:
            return None
        counts = []
        for seq in seqs:
            self.allocator.allocate(seq, seq.num_uncomputed_tokens)
            counts.append(seq.num_uncomputed_tokens)
        return ScheduledBatch(tuple(seqs), tuple(counts))
