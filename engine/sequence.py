"""Sequence: one request's tokens, progress and KV placement. Pure Python."""

from __future__ import annotations

from enum import Enum, StrEnum
from typing import Protocol

from engine.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(StrEnum):
    LENGTH = "length"
    EOS = "eos_token"
    STOP = "stop_sequence"
    ABORT = "abort"
    TIMEOUT = "timeout"
    ERROR = "error"


class Constraint(Protocol):
    """A grammar state that follows the sequence's output (engine/guided.py)."""

    def accept(self, token_id: int) -> None: ...

    @property
    def finished(self) -> bool: ...

    @property
    def error(self) -> str | None: ...


class Sequence:
    """Owns its token ids, how many of them have KV (`num_computed_tokens`) and its block table.

    Prefill, chunked prefill and decode are not modes: each step schedules some tokens so that
    `num_computed_tokens` catches up with `num_tokens`; a token is sampled when it does.
    """

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: list[int] | tuple[int, ...],
        params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        sampling_seed: int = 0,
        arrival_time: float = 0.0,
    ) -> None:
        assert prompt_token_ids, "a sequence needs at least one prompt token"
        self.seq_id = seq_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.params = params
        self.eos_token_ids = eos_token_ids
        # Sampled requests draw from (sampling_seed, output position): reproducible whatever the
        # batch around them, and unchanged by preemption + recompute.
        self.sampling_seed = sampling_seed
        self.arrival_time = arrival_time
        self.num_preemptions = 0
        # Guided decoding: the sampler masks what the grammar forbids; every output token
        # advances it. It lives as long as the sequence: preemption keeps the output tokens.
        self.constraint: Constraint | None = None

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, status={self.status.value})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def max_total_tokens(self) -> int:
        """Tokens this sequence may hold at most: prompt + max_new_tokens."""
        return self.num_prompt_tokens + self.params.max_new_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        assert self.num_computed_tokens == self.num_tokens, "sampled before catching up"
        self.token_ids.append(token_id)
        if self.constraint is not None:
            self.constraint.accept(token_id)

    def token_finish_reason(self) -> FinishReason | None:
        """Why the last appended token ends the sequence (EOS or length), if it does."""
        if self.num_output_tokens >= self.params.max_new_tokens:
            return FinishReason.LENGTH
        if (not self.params.ignore_eos and self.num_output_tokens > 0
                and self.token_ids[-1] in self.eos_token_ids
                and self.num_output_tokens > self.params.min_new_tokens):
            return FinishReason.EOS
        if self.constraint is not None:
            if self.constraint.error is not None:
                return FinishReason.ERROR
            if self.constraint.finished:  # complete: only EOS could follow; spare that step
                return FinishReason.EOS
        return None

    def finish(self, reason: FinishReason) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
