"""OpenAI's legacy completions (`POST /v1/completions`), `GET /v1/models`, and the OpenAI error
shape that the /v1 routes answer with."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from engine import TokenEvent
from handler.http.chat import (
    FINISH_REASONS,
    OPENAI_PARAMETERS,
    choices_asked,
    guided,
    include_usage,
    usage,
)
from handler.http.schemas import (
    PROBE,
    HTTPError,
    around_probe,
    bad_request,
    fill_probe,
    framed,
    sampling_params,
)
from handler.http.structured import STRUCTURED_FIELDS

_FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream",
           "stream_options", "logprobs", "stop", "seed", "echo", "user", "ignore_eos",
           "frequency_penalty", "presence_penalty", "best_of", *STRUCTURED_FIELDS}
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
MAX_LOGPROBS = 5  # OpenAI's limit for completions' logprobs
# HTTP status → OpenAI's error type
_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
                415: "invalid_request_error", 429: "rate_limit_error",
                503: "service_unavailable_error"}


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list[str]
    params: object
    stream: bool
    include_usage: bool
    logprobs: int | None
    echo: bool
    completion_id: str
    created: int
    n: int = 1  # choices per prompt


def parse_completion(body: dict) -> CompletionRequest:
    """Validate an OpenAI completions body; what batchyard cannot do is an error, not ignored."""
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise bad_request(f"unknown completions fields: {', '.join(unknown)}")
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(
            isinstance(p, str) and p for p in prompts):
        raise bad_request("prompt must be a non-empty string or a list of them")
    if body.get("best_of") not in (1, None):
        raise bad_request("best_of must be 1 or absent (not supported)")
    stream, echo = body.get("stream", False), body.get("echo", False)
    n = choices_asked(body, stream=stream)
    if not isinstance(stream, bool) or not isinstance(echo, bool):
        raise bad_request("stream and echo must be booleans")
    if stream and len(prompts) > 1:
        raise bad_request("stream=true takes one prompt, not a list")
    logprobs = body.get("logprobs")
    if logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool)
                                 or not 0 <= logprobs <= MAX_LOGPROBS):
        raise bad_request(f"logprobs must be an integer from 0 to {MAX_LOGPROBS}")
    parameters = {k: body[k] for k in OPENAI_PARAMETERS if body.get(k) is not None}
    max_tokens = body.get("max_tokens")  # 0 is an error, not the default
    parameters["max_new_tokens"] = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    try:
        params = sampling_params(parameters, logprobs or 0)
    except HTTPError as err:
        raise bad_request(completion_names(err.message)) from err
    params = replace(params, guided=guided(body))
    return CompletionRequest(prompts, params, stream, include_usage(body), logprobs, echo,
                             f"cmpl-{uuid.uuid4().hex}", int(time.time()), n)


def completion_names(message: str) -> str:
    """An error message in the completions body's field names."""
    message = message.replace("parameters.", "").replace("stop_sequences", "stop")
    return re.sub(r"\binputs\b", "prompt", message.replace("max_new_tokens", "max_tokens"))


def _logprobs(events: list[TokenEvent], decode: Callable[[list[int]], str]) -> dict:
    """OpenAI's completions logprobs: tokens, their log-probabilities, top alternatives."""
    tokens = [e for e in events if e.token_id is not None]
    offsets, offset = [], 0
    for e in tokens:
        offsets.append(offset)
        offset += len(e.text)
    return {"tokens": [e.text for e in tokens], "token_logprobs": [e.logprob for e in tokens],
            "top_logprobs": [{decode([i]): lp for i, lp in e.top_logprobs} for e in tokens],
            "text_offset": offsets}


def completion(req: CompletionRequest, model: str, answers: list[list[TokenEvent]], *,
               decode: Callable[[list[int]], str]) -> dict:
    """The whole answer: n choices per prompt, prompt by prompt (answers in that order)."""
    choices = []
    prompts = [p for p in req.prompts for _ in range(req.n)]
    for index, (prompt, events) in enumerate(zip(prompts, answers, strict=True)):
        text = "".join(e.text for e in events)
        choices.append({"index": index, "text": prompt + text if req.echo else text,
                        "logprobs": _logprobs(events, decode) if req.logprobs is not None
                        else None,
                        "finish_reason": FINISH_REASONS.get(events[-1].finish_reason or "",
                                                            "stop")})
    prompt_tokens = sum(events[-1].num_prompt_tokens for events in answers[::req.n])
    completion_tokens = sum(events[-1].num_output_tokens for events in answers)
    return {"id": req.completion_id, "object": "text_completion", "created": req.created,
            "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def completion_chunk(req: CompletionRequest, model: str, event: TokenEvent, *, first: bool,
                     decode: Callable[[list[int]], str], index: int = 0) -> dict:
    """One streamed chunk: the token's text (the prompt first, with echo); the last has the
    finish reason."""
    text = (req.prompts[0] if first and req.echo else "") + event.text
    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": None}
    if req.logprobs is not None and event.token_id is not None:
        choice["logprobs"] = _logprobs([event], decode)
    if event.finished:
        choice["finish_reason"] = FINISH_REASONS.get(event.finish_reason or "", "stop")
    return {"id": req.completion_id, "object": "text_completion", "created": req.created,
            "model": model, "choices": [choice]}


class CompletionLines:
    """A completion stream's chunks by choice. A plain text chunk (no echo, logprobs or
    finish) comes as its SSE line, made from the choice's chunk JSON around its text (split
    once per choice: json.dumps's text, ~3x sooner; one per token); others as dicts."""

    def __init__(self, req: CompletionRequest, model: str,
                 decode: Callable[[list[int]], str]) -> None:
        self.req, self.model, self.decode = req, model, decode
        self._around: dict[int, tuple[str, str] | None] = {}

    def line(self, event: TokenEvent, *, first: bool, index: int) -> dict | str:
        req = self.req
        plain = not event.finished and not (first and req.echo) and (
            req.logprobs is None or event.token_id is None)
        around = self._around_text(index) if plain else None
        if around is None:
            return completion_chunk(req, self.model, event, first=first, decode=self.decode,
                                    index=index)
        return framed(fill_probe(around, event.text), sse=True)

    def _around_text(self, index: int) -> tuple[str, str] | None:
        if index not in self._around:
            probe = TokenEvent("probe", None, PROBE, None, 0, 1, None)
            self._around[index] = around_probe(completion_chunk(
                self.req, self.model, probe, first=False, decode=self.decode, index=index))
        return self._around[index]


def usage_chunk(completion_id: str, obj: str, created: int, model: str,
                last: TokenEvent | list[TokenEvent]) -> dict:
    """stream_options.include_usage's last chunk: no choices, the request's usage."""
    return {"id": completion_id, "object": obj, "created": created, "model": model,
            "choices": [], "usage": usage(last)}


def models(model: str, created: int, adapters: Sequence[tuple[str, str]] = ()) -> dict:
    """The base model's card, then one per LoRA adapter (vLLM's: root its folder, parent the
    base model)."""
    base = {"id": model, "object": "model", "created": created, "owned_by": "batchyard"}
    cards = [{**base, "id": name, "root": folder, "parent": model} for name, folder in adapters]
    return {"object": "list", "data": [base, *cards]}


def openai_error(err: HTTPError) -> dict:
    """{"error": {...}} as OpenAI's API answers: `type` its category, `code` batchyard's stable
    error name (BadRequest, QueueFull, ...; the HTTP status is the response's)."""
    kind = _ERROR_TYPES.get(err.code, "server_error" if err.code >= 500 else
                            "invalid_request_error")
    return {"error": {"message": err.message, "type": kind, "param": None, "code": err.type}}
