"""What enters the engine: a caller's typed request, and the loop's inbox messages."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampling_params import RequestError, SamplingParams
from engine.sequence import FinishReason


@dataclass(frozen=True)
class GenerationRequest:
    """One generation a caller asks for: prompt token ids (see EngineClient.encode) and knobs."""

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    # time.monotonic() after which the request is dropped, queued or running; None: never.
    deadline: float | None = None


@dataclass(frozen=True)
class AddRequest:
    """Inbox message: queue a request, already validated at the boundary, under this id."""

    request_id: str
    request: GenerationRequest


@dataclass(frozen=True)
class PrefillRequest(AddRequest):
    """Inbox message of a disaggregated prefill worker (engine/disagg/): prefill the prompt,
    sample its first token, then send its KV to decode worker `decode_rank`."""

    decode_rank: int = 0


@dataclass(frozen=True)
class CooperativeSlice(PrefillRequest):
    """Inbox message of a prefill worker sharing one long prompt with others (KV-Runahead):
    compute its tokens slice_start..len(prompt)-1 in one step, the K/V before them arriving
    layer by layer from worker `prev_rank`, and pass each layer's K/V of the whole request so
    far on to worker `next_rank`; the last slice (next_rank None) samples the first token and
    hands the KV to decode_rank. `coop_id` tells this prompt's transfers from others'."""

    coop_id: int = 0
    slice_start: int = 0
    prev_rank: int | None = None
    next_rank: int | None = None


@dataclass(frozen=True)
class AddPrefilled(AddRequest):
    """Inbox message of a disaggregated decode worker: a request whose first token prefill
    worker `src` sampled, and whose `num_kv_tokens` prompt tokens' KV it is sending."""

    token_id: int = 0
    seed: int = 0
    num_kv_tokens: int = 0
    src: int = 0


@dataclass(frozen=True)
class AbortRequest:
    """Inbox message: end a request now and free its KV (its caller went away)."""

    request_id: str
    reason: FinishReason = FinishReason.ABORT
    error: str | None = None


@dataclass(frozen=True)
class AddAdapter:
    """Inbox message: register the PEFT folder `path` as LoRA adapter `name`; the core answers
    `call_id` (unique among its callers) in its next update."""

    call_id: str
    name: str
    path: str


@dataclass(frozen=True)
class RemoveAdapter:
    """Inbox message: unregister LoRA adapter `name` (requests using it finish first)."""

    call_id: str
    name: str


@dataclass(frozen=True)
class StopCore:
    """Inbox message: stop stepping; the core ends what is left with an error."""


@dataclass(frozen=True)
class RequestLimits:
    """What a request may hold, fixed at start-up: the boundary validates against it, on
    whichever side of a process the engine runs."""

    max_model_len: int
    max_seq_tokens: int  # the most one sequence can hold in the KV pool
    vocab_size: int

    def validate(self, prompt_token_ids: tuple[int, ...] | list[int],
                 params: SamplingParams) -> None:
        """Raise RequestError if this request can never run (empty, too long, bad token ids)."""
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestError("inputs must not be empty (0 tokens after tokenization)", "inputs")
        limit, name = self.max_model_len, "max_model_len"
        if self.max_seq_tokens < limit:
            limit, name = self.max_seq_tokens, "the whole KV pool"
        if n + params.max_new_tokens > limit:
            raise RequestError(
                f"inputs tokens + max_new_tokens must be <= {limit} ({name}). "
                f"Given: {n} inputs tokens and {params.max_new_tokens} max_new_tokens", "inputs")
        if not all(0 <= t < self.vocab_size for t in prompt_token_ids):
            raise RequestError(f"token ids must be in [0, {self.vocab_size})", "inputs")
