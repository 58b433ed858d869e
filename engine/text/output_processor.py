"""The output stage: token ids from the engine core → text events, stop strings included.

The core step (LLMEngine.step_outputs) only schedules and computes; turning ids into text is
Python string work that would otherwise keep the device idle. Offline, LLMEngine.step() runs this
stage inline and ends a stopped sequence before the next step, as always. Served, EngineLoop runs
it on its own thread: a stop string found there reaches the core as an abort one step late, so a
token may be computed past the stop and is dropped here, never returned (vLLM's output processor
does the same).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from engine.outputs import TokenEvent
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason
from engine.text.detokenizer import IncrementalText

_STOP = FinishReason.STOP.value  # read once per row: an enum member's .value is a slow lookup


class StepOutput(NamedTuple):
    """The core's news for one request in one step: a token id, its end, or both. A named
    tuple: the core makes one per running sequence per step (a frozen dataclass cost 3x to
    build); to the serving process they go as CoreUpdate's columns."""

    request_id: str
    token_id: int | None
    logprob: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None = None
    error: str | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass
class _Stream:
    params: SamplingParams
    text: IncrementalText


class OutputProcessor:
    """One incremental detokenizer per live request. add() may run on the core's thread;
    process() on one thread only (the core's offline, the output thread when served)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer.backend_tokenizer
        self._streams: dict[str, _Stream] = {}

    def add(self, request_id: str, params: SamplingParams) -> None:
        self._streams[request_id] = _Stream(params, IncrementalText(self._tokenizer, params.stop))

    def discard(self, request_id: str) -> None:
        """Forget a request (its outputs failed here); later outputs for it are dropped."""
        self._streams.pop(request_id, None)

    def process(self, outputs: list[StepOutput]) -> tuple[list[TokenEvent], list[str]]:
        """Events for `outputs`, and the ids of requests a stop string has just ended (their
        sequences still run in the core until it is told)."""
        events, stopped = [], []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # already ended here by a stop string: a late token, dropped
                continue
            event = self._event(out, stream)
            if event.finish_reason == _STOP and out.finish_reason is None:
                stopped.append(out.request_id)
            if event.finished:
                del self._streams[out.request_id]
            events.append(event)
        return events, stopped

    def _event(self, out: StepOutput, stream: _Stream) -> TokenEvent:
        finish_reason = out.finish_reason
        if out.token_id is None:  # ended without a token: abort, timeout, error
            delta = stream.text.flush()
        else:
            p = stream.params
            check_stop = bool(p.stop) and finish_reason is None and (
                out.num_output_tokens >= p.min_new_tokens)
            delta, hit = stream.text.add(out.token_id, check_stop=check_stop)
            if hit:
                finish_reason = _STOP
            elif finish_reason is not None:
                delta += stream.text.flush()
        return TokenEvent(out.request_id, out.token_id, delta, out.logprob, out.num_prompt_tokens,
                          out.num_output_tokens, finish_reason, out.error, out.top_logprobs)
