"""SamplingParams: one request's decoding knobs, validated where they are built."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.guided import GuidedSpec

MAX_STOP_SEQUENCES = 16
MAX_STOP_SEQUENCE_CHARS = 256
# Beyond these, sampling divides by ~0 or the penalty swamps the logits: no use, only NaNs.
TEMPERATURE_RANGE = (0.01, 100.0)
REPETITION_PENALTY_RANGE = (0.01, 100.0)
OPENAI_PENALTY_RANGE = (-2.0, 2.0)  # frequency_penalty, presence_penalty: OpenAI's range
MAX_TOP_LOGPROBS = 20


class RequestError(ValueError):
    """A request the engine refuses; the message names the field and the limit (HTTP 400)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters. Greedy unless do_sample is set."""

    max_new_tokens: int = 30
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    repetition_penalty: float = 1.0  # 1.0: off
    # OpenAI's: minus penalty x count (frequency) or x 1 (presence) for each token already
    # generated (the output, not the prompt, as OpenAI and vLLM define them); 0.0: off
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    top_logprobs: int = 0  # most likely alternatives reported with each token
    guided: GuidedSpec | None = None  # a grammar the output must match (engine/guided.py)
    # the LoRA adapter whose update the request's rows add (engine/lora/); None: the base model
    adapter: str | None = None

    def __post_init__(self) -> None:
        _require(self.adapter is None or (isinstance(self.adapter, str)
                                          and 0 < len(self.adapter) <= 256),
                 "adapter", "must be an adapter name of 1-256 characters", self.adapter)
        _require(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1", self.max_new_tokens)
        _require(0 <= self.min_new_tokens <= self.max_new_tokens, "min_new_tokens",
                 f"must be between 0 and max_new_tokens ({self.max_new_tokens})",
                 self.min_new_tokens)
        low, high = TEMPERATURE_RANGE
        _require(self.temperature == 0 or low <= self.temperature <= high, "temperature",
                 f"must be 0 (greedy) or between {low:g} and {high:g}", self.temperature)
        _require(not self.do_sample or self.temperature > 0, "temperature",
                 "must be > 0 when do_sample is true", self.temperature)
        # Bounded above too: the sampler packs it into an int64 tensor with the batch's others.
        _require(0 <= self.top_k < 2**31, "top_k", "must be between 0 (off) and 2**31 - 1",
                 self.top_k)
        _require(0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        low, high = REPETITION_PENALTY_RANGE
        _require(low <= self.repetition_penalty <= high, "repetition_penalty",
                 f"must be between {low:g} and {high:g}", self.repetition_penalty)
        low, high = OPENAI_PENALTY_RANGE
        for name in ("frequency_penalty", "presence_penalty"):
            _require(low <= getattr(self, name) <= high, name,
                     f"must be between {low:g} and {high:g}", getattr(self, name))
        _require(0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, "top_logprobs",
                 f"must be between 0 and {MAX_TOP_LOGPROBS}", self.top_logprobs)
        _require(self.seed is None or 0 <= self.seed < 2**63, "seed",
                 "must be an integer in [0, 2**63)", self.seed)
        _require(len(self.stop) <= MAX_STOP_SEQUENCES, "stop_sequences",
                 f"at most {MAX_STOP_SEQUENCES} entries", len(self.stop))
        for s in self.stop:
            _require(0 < len(s) <= MAX_STOP_SEQUENCE_CHARS, "stop_sequences",
                     f"each entry must have 1 to {MAX_STOP_SEQUENCE_CHARS} characters", len(s))

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    @cached_property  # read for every row of every step
    def argmax_only(self) -> bool:
        """Greedy with no penalty: the token is the argmax of the raw logits."""
        return (self.greedy and self.repetition_penalty == 1.0 and not self.frequency_penalty
                and not self.presence_penalty)


def _require(ok: bool, field: str, rule: str, given: object) -> None:
    if isinstance(given, float) and not math.isfinite(given):
        ok = False
    if not ok:
        shown = repr(given)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise RequestError(f"parameters.{field} {rule} (given: {shown})", field=field)
