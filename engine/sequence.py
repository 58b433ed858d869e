"""Sequence: one request's tokens, progress and KV placement. Pure Python."""

from __future__ import annotations

from enum import Enum, StrEnum
from typing import Protocol

from engine.sampling_params import SamplingParams

# A token sampled by a step still on the device (asynchronous scheduling): the next step reads
# it from the device, and the host writes it in when that step's results arrive.
PENDING_TOKEN = -1


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
    INVALID = "invalid"  # the request's own input (its grammar) failed while generating: a 4xx
    # the LoRA adapter it names is not registered (LMI answers 424, OpenAI's routes 404)
    UNKNOWN_ADAPTER = "unknown_adapter"


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
        # One block table per KV group (engine/kv/layout.py); most models have one.
        self.block_tables: list[list[int]] = [[]]
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
        # Trailing PENDING_TOKENs: sampled on the device, not yet known to the host.
        self.num_pending = 0
        # Its KV is rotated with LongRoPE's long factors (set by the scheduler, Phi-3).
        self.long_rope = False
        # The LoRA registration it runs with ("name@n", engine/lora/manager.py), None: the base
        # model. Set when it is queued; keys its prefix cache blocks and its device slot.
        self.lora_key: str | None = None
        # Speculative decoding (engine/spec/): trailing proposed tokens, scheduled with its last
        # one and verified by the step's samples; never cached, never reported until accepted.
        self.num_drafts = 0
        # Disaggregated decode (engine/disagg/): leading tokens whose KV another worker
        # computed; admission places it in the sequence's blocks instead of computing it.
        self.num_remote_kv_tokens = 0
        self.kv_import_start: int | None = None  # admitted: where the placing starts
        # A slice of a prompt several prefill workers share (KV-Runahead): computed in one
        # step, trading K/V with the other workers between layers; never matched in the cache.
        self.cooperative = False

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, status={self.status.value})")

    @property
    def block_table(self) -> list[int]:
        """The first (usually only) block table."""
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables = [table]

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

    @property
    def num_known_tokens(self) -> int:
        """Tokens the host knows: all but the pending ones."""
        return len(self.token_ids) - self.num_pending

    @property
    def num_known_output_tokens(self) -> int:
        return self.num_known_tokens - self.num_prompt_tokens

    @property
    def num_verified_tokens(self) -> int:
        """Tokens the host knows that are not proposals awaiting verification."""
        return self.num_known_tokens - self.num_drafts

    def propose(self, drafts: list[int]) -> None:
        """Append speculative tokens after the last sampled one, to be verified in one step."""
        assert not self.num_drafts and not self.num_pending and self.num_uncomputed_tokens == 1
        self.token_ids += drafts
        self.num_drafts = len(drafts)

    def withdraw_drafts(self) -> None:
        """Drop the proposals not yet computed (no room for them, preempted)."""
        if self.num_drafts:
            assert not self.num_pending, "withdrawn after its step launched"
            del self.token_ids[-self.num_drafts:]
            self.num_drafts = 0
            self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens)

    def settle_drafts(self) -> list[int]:
        """Its verifying step's samples arrived: remove the proposals and the pending place
        after them (the accepted ones come back through append_token); returns the
        proposals."""
        k = self.num_drafts
        assert k and self.num_pending == 1 and self.token_ids[-1] == PENDING_TOKEN
        drafts = self.token_ids[-k - 1:-1]
        del self.token_ids[-k - 1:]
        self.num_pending = self.num_drafts = 0
        self.num_computed_tokens = self.num_tokens
        return drafts

    @property
    def awaits_last_token(self) -> bool:
        """Its last token is sampled but still on the device: nothing is left to schedule."""
        return self.num_pending > 0 and self.num_output_tokens >= self.params.max_new_tokens

    @property
    def needs_known_tokens(self) -> bool:
        """Whether the sampler reads this sequence's generated tokens on the host (a grammar's
        mask, penalties over what it said): its next step then waits for the last one."""
        p = self.params
        return bool(self.constraint is not None or p.repetition_penalty != 1.0
                    or p.frequency_penalty or p.presence_penalty)

    def append_token(self, token_id: int) -> None:
        self.append_pending()
        self.resolve_token(token_id)

    def append_pending(self) -> None:
        """A step that catches this sequence up is on its way: hold a place for its token."""
        assert self.num_computed_tokens == self.num_tokens, "sampled before catching up"
        self.token_ids.append(PENDING_TOKEN)
        self.num_pending += 1

    def resolve_token(self, token_id: int) -> None:
        """The oldest pending token arrived from the device."""
        at = self.num_known_tokens
        assert self.num_pending and self.token_ids[at] == PENDING_TOKEN, "no pending token"
        self.token_ids[at] = token_id
        self.num_pending -= 1
        if self.constraint is not None:
            self.constraint.accept(token_id)

    def token_finish_reason(self) -> FinishReason | None:
        """Why the last known token ends the sequence (EOS or length), if it does."""
        outputs = self.num_known_output_tokens
        if outputs >= self.params.max_new_tokens:
            return FinishReason.LENGTH
        if (not self.params.ignore_eos and outputs > 0
                and self.token_ids[self.num_known_tokens - 1] in self.eos_token_ids
                and outputs > self.params.min_new_tokens):
            return FinishReason.EOS
        if self.constraint is not None:
            if self.constraint.error is not None:
                return FinishReason.INVALID
            if self.constraint.finished:  # complete: only EOS could follow; spare that step
                return FinishReason.EOS
        return None

    def finish(self, reason: FinishReason) -> None:
        """End it; a token still pending (computed ahead, asynchronous scheduling) is dropped."""
        if self.num_pending:
            del self.token_ids[self.num_known_tokens:]
            self.num_pending = 0
        if self.num_drafts:  # unverified proposals are no output
            del self.token_ids[-self.num_drafts:]
            self.num_drafts = 0
        self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens)
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
