"""What enters the engine: a caller's typed request, and the loop's inbox messages."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampling_params import SamplingParams
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
class AbortRequest:
    """Inbox message: end a request now and free its KV (its caller went away)."""

    request_id: str
    reason: FinishReason = FinishReason.ABORT
    error: str | None = None
