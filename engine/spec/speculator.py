"""The speculation policy of one engine: which running sequences get proposals and how many,
and what a verifying step's samples accept. Pure Python.

A proposal is verified by sampling the target at every proposed position with the sequence's
own parameters and seeds (the sampler draws output position m from (seed, m) alone), then
keeping proposals while they equal those samples, plus the first sample that differs (or the
one after the last proposal). For a deterministic proposer (n-gram) this is the rejection rule
with a one-hot draft distribution (accept x with probability p(x), else draw from p without x):
greedy and sampled output are exactly what decoding without speculation gives, seed for seed."""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Protocol

from engine.outputs import SampledToken
from engine.sequence import Sequence, SequenceStatus
from engine.spec.ngram import NgramIndex

logger = logging.getLogger(__name__)

LOG_EVERY_SECONDS = 10.0  # the metrics line, at most this often while speculating
# the batch size up to which every sequence may propose the full length; above it the
# length shrinks in proportion, to none past length x FULL_LENGTH_BATCH sequences (a verified
# proposal is nearly free only while decode is memory-bound: on 2 CPU cores, 32 sequences
# proposing one token each served 0.89x of not proposing, at 60 % acceptance)
FULL_LENGTH_BATCH = 4


class DraftModel(Protocol):
    """A proposer with a model (engine/spec/draft.py): up to k tokens per wanted sequence."""

    def propose(self, wanted: list[tuple[Sequence, int]], running: list[Sequence]
                ) -> list[list[int]]: ...


@dataclass
class SpecCounters:
    """vLLM's spec_decode counters: proposals verified, tokens proposed, tokens accepted (and
    accepted per position)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, proposed: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        if len(self.accepted_per_position) < proposed:
            self.accepted_per_position += [0] * (proposed - len(self.accepted_per_position))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted per proposal: tokens a verifying step yields per sequence."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else 0.0


class Speculator:
    """n-gram proposals of up to `length` tokens (prompt lookup of min_n..max_n tokens); none
    when more than `disable_batch_size` sequences run."""

    def __init__(self, length: int, min_n: int, max_n: int, max_model_len: int,
                 disable_batch_size: int | None = None, draft: DraftModel | None = None) -> None:
        self.length, self.min_n, self.max_n = length, min_n, max_n
        self.max_model_len = max_model_len
        self.disable_batch_size = disable_batch_size
        self.draft = draft  # None: n-gram prompt lookup
        # LongRoPE: a sequence crossing this length recomputes in long mode; proposals must not
        # cross it before its verified tokens do (the engine sets it from the scheduler)
        self.long_rope_after: int | None = None
        self.counters = SpecCounters()
        self._logged_at = time.monotonic()
        self._logged = SpecCounters()
        # per sequence: its token index and its current proposal length (adapted to what it
        # accepts); weak, so a finished sequence takes them with it
        self._index: weakref.WeakKeyDictionary[Sequence, NgramIndex] = (
            weakref.WeakKeyDictionary())
        self._length: weakref.WeakKeyDictionary[Sequence, int] = weakref.WeakKeyDictionary()

    def propose(self, running: list[Sequence]) -> int:
        """Give each running sequence about to decode its proposals; returns how many got some."""
        batch = len(running)
        wanted: list[tuple[Sequence, int]] = []
        batch_length = self.length * FULL_LENGTH_BATCH // max(batch, FULL_LENGTH_BATCH)
        if batch_length and (self.disable_batch_size is None
                             or batch <= self.disable_batch_size):
            for seq in running:
                room = min(seq.max_total_tokens, self.max_model_len) - seq.num_tokens - 1
                if self.long_rope_after is not None and not seq.long_rope:
                    room = min(room, self.long_rope_after - seq.num_tokens)
                k = min(self._length.get(seq, self.length), batch_length, room)
                if k > 0 and _may_propose(seq):
                    wanted.append((seq, k))
        if self.draft is not None:
            proposals = self.draft.propose(wanted, running)
        else:
            proposals = [self._lookup(seq, k) for seq, k in wanted]
        proposing = 0
        for (seq, _), drafts in zip(wanted, proposals, strict=True):
            if drafts:
                seq.propose(drafts)
                proposing += 1
        return proposing

    def _lookup(self, seq: Sequence, k: int) -> list[int]:
        index = self._index.get(seq)
        if index is None:
            index = self._index[seq] = NgramIndex()
        return index.propose(seq.token_ids, self.min_n, self.max_n, k)

    def verify(self, seq: Sequence, drafts: list[int],
               samples: list[SampledToken]) -> list[SampledToken]:
        """The tokens a verifying step yields for `seq`: its samples while they equal the
        proposals, then the first that differs (or the one after the last proposal). Count
        them with count() once the sequence has taken them."""
        assert len(samples) == len(drafts) + 1, "one sample per proposal, plus one"
        accepted = 0
        while accepted < len(drafts) and samples[accepted].token_id == drafts[accepted]:
            accepted += 1
        current = self._length.get(seq, self.length)
        # all accepted: grow back; none: halve; else what it accepted, and one more
        self._length[seq] = (min(self.length, current + 1) if accepted == len(drafts)
                             else max(1, current // 2) if accepted == 0 else accepted + 1)
        return samples[:accepted + 1]

    def count(self, proposed: int, taken: int) -> None:
        """A sequence took `taken` tokens of a verification of `proposed` proposals (an end,
        EOS or length, may stop it inside the accepted ones: those after it count not)."""
        self.counters.add(proposed, taken - 1)

    def log_metrics(self, force: bool = False) -> str | None:
        """Every LOG_EVERY_SECONDS (or now): vLLM's SpecDecoding metrics line over the window
        since the last one; returns it (None: nothing to say yet)."""
        now, c, old = time.monotonic(), self.counters, self._logged
        if c.drafts == old.drafts or (not force and now - self._logged_at < LOG_EVERY_SECONDS):
            return None
        drafts, proposed = c.drafts - old.drafts, c.draft_tokens - old.draft_tokens
        accepted = c.accepted_tokens - old.accepted_tokens
        per_position = [(n - (old.accepted_per_position[i] if i < len(old.accepted_per_position)
                              else 0)) / drafts for i, n in enumerate(c.accepted_per_position)]
        line = (f"SpecDecoding metrics: Mean acceptance length {1 + accepted / drafts:.2f}, "
                f"Avg Draft acceptance rate {100 * accepted / max(1, proposed):.1f}%, "
                f"proposals {drafts}, Per-position acceptance rate "
                f"{', '.join(f'{r:.3f}' for r in per_position)}")
        logger.info(line)
        self._logged_at = now
        self._logged = SpecCounters(c.drafts, c.draft_tokens, c.accepted_tokens,
                                    list(c.accepted_per_position))
        return line


def _may_propose(seq: Sequence) -> bool:
    """A running sequence whose next step is a plain decode, whose sampler reads no generated
    tokens on the host (grammars, penalties)."""
    return (seq.status is SequenceStatus.RUNNING and not seq.num_drafts
            and not seq.num_pending and seq.num_uncomputed_tokens == 1
            and seq.num_output_tokens > 0 and not seq.needs_known_tokens)
