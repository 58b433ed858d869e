"""OpenAI chat-completions schema on /invocations and /v1/chat/completions."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace

from engine import TokenEvent
from handler.http.schemas import HTTPError, bad_request, sampling_params

_CHAT_FIELDS = {"messages", "model", "max_tokens", "max_completion_tokens", "temperature",
                "top_p", "seed", "stop", "stream", "logprobs", "top_logprobs", "n",
                "frequency_penalty", "presence_penalty", "ignore_eos", "user",
                "stream_options"}
MAX_CHOICES = 16  # n per request
FINISH_REASONS = {"length": "length", "eos_token": "stop", "stop_sequence": "stop"}


@dataclass(frozen=True)
class ChatRequest:
    """A parsed chat body; `params` carries the generation knobs."""

    messages: list[dict]
    params: object
    stream: bool
    logprobs: bool
    completion_id: str
    created: int
    max_field: str = "max_tokens"  # the body's name for max_new_tokens, used in errors
    include_usage: bool = False  # stream_options.include_usage
    n: int = 1  # choices


def parse_chat(body: dict, *, wants_stream: bool) -> ChatRequest:
    """Validate an OpenAI chat body; unsupported options are errors, not silently ignored."""
    unknown = sorted(set(body) - _CHAT_FIELDS)
    if unknown:
        raise bad_request(f"unknown chat fields: {', '.join(unknown)}")
    messages = body["messages"]
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in messages):
        raise bad_request("messages must be a non-empty list of {role: str, content: str}")
    n = choices_asked(body, stream=body.get("stream", wants_stream))
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name, 0) not in (0, None):
            raise bad_request(f"{name} is not supported (must be 0 or absent)")
    logprobs = body.get("logprobs", False)
    stream = body.get("stream", wants_stream)
    if not isinstance(logprobs, bool) or not isinstance(stream, bool):
        raise bad_request("logprobs and stream must be booleans")
    top_logprobs = body.get("top_logprobs") or 0
    if not isinstance(top_logprobs, int) or isinstance(top_logprobs, bool) or (
            top_logprobs and not logprobs):
        raise bad_request("top_logprobs must be an integer from 0 to 20, with logprobs true")
    parameters = {k: body[k] for k in ("temperature", "top_p", "seed", "stop", "ignore_eos")
                  if body.get(k) is not None}
    # OpenAI's newer name wins when given, as before; errors then name it.
    max_field = ("max_completion_tokens" if body.get("max_completion_tokens") is not None
                 else "max_tokens")
    if body.get(max_field) is not None:
        parameters["max_new_tokens"] = body[max_field]
    try:
        params = sampling_params(parameters, top_logprobs)
    except HTTPError as err:
        raise bad_request(chat_names(err.message, max_field)) from err
    return ChatRequest(messages, params, stream, logprobs, f"chatcmpl-{uuid.uuid4().hex}",
                       int(time.time()), max_field, include_usage({**body, "stream": stream}), n)


def choices_asked(body: dict, *, stream: object) -> int:
    """OpenAI's `n`: 1 to MAX_CHOICES answers to one prompt, each its own sequence (a seeded
    request's choice i uses seed + i); one when streaming."""
    n = body.get("n")
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"n must be an integer from 1 to {MAX_CHOICES}")
    if n > 1 and stream is True:
        raise bad_request("n > 1 cannot be streamed yet; send stream=false or n=1")
    return n


def each_choice(params, n: int) -> list:
    """The SamplingParams of each of n choices: a seeded request's choice i draws with
    seed + i, so that the choices differ and each is reproducible."""
    if n == 1 or params.seed is None:
        return [params] * n
    return [replace(params, seed=(params.seed + i) % 2**63) for i in range(n)]  # seeds' range


def include_usage(body: dict) -> bool:
    """stream_options.include_usage: a last chunk with the usage and no choices."""
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"} or not isinstance(
            options.get("include_usage", False), bool):
        raise bad_request('stream_options must be {"include_usage": true|false}')
    if options and not body.get("stream"):
        raise bad_request("stream_options needs stream=true")
    return options.get("include_usage", False)


def chat_names(message: str, max_field: str = "max_tokens") -> str:
    """An error message in the chat body's own field names: chat fields are top-level, and the
    client sent max_tokens (or max_completion_tokens), not max_new_tokens."""
    message = message.replace("parameters.", "").replace("stop_sequences", "stop")
    message = re.sub(r"\bmax_new_tokens\b", max_field, message)
    return re.sub(r"\binputs tokens\b", "messages tokens", message)


def _logprobs(events: list[TokenEvent], decode: Callable[[list[int]], str]) -> dict:
    """OpenAI's logprobs.content: each token, its log-probability and the top alternatives."""
    def entry(text: str, logprob: float | None) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(e.text, e.logprob),
                         "top_logprobs": [entry(decode([i]), lp) for i, lp in e.top_logprobs]}
                        for e in events if e.token_id is not None]}


def usage(last: TokenEvent) -> dict:
    return {"prompt_tokens": last.num_prompt_tokens, "completion_tokens": last.num_output_tokens,
            "total_tokens": last.num_prompt_tokens + last.num_output_tokens}


def chat_completion(req: ChatRequest, model: str, answers: list[list[TokenEvent]], *,
                    decode: Callable[[list[int]], str]) -> dict:
    """One choice per answer (n of them, to one prompt: its tokens are counted once)."""
    choices = [{"index": i,
                "message": {"role": "assistant", "content": "".join(e.text for e in events)},
                "logprobs": _logprobs(events, decode) if req.logprobs else None,
                "finish_reason": FINISH_REASONS.get(events[-1].finish_reason or "", "stop")}
               for i, events in enumerate(answers)]
    total = usage(answers[0][-1])
    total["completion_tokens"] = sum(events[-1].num_output_tokens for events in answers)
    total["total_tokens"] = total["prompt_tokens"] + total["completion_tokens"]
    return {"id": req.completion_id, "object": "chat.completion", "created": req.created,
            "model": model, "choices": choices, "usage": total}


def chat_chunk(req: ChatRequest, model: str, event: TokenEvent | None, *, first: bool,
               decode: Callable[[list[int]], str]) -> dict:
    """One streamed chunk: the role first, then content deltas; the last has finish + usage."""
    delta: dict = {"role": "assistant", "content": ""} if first else {}
    if event is not None and event.text:
        delta["content"] = event.text
    chunk = {"id": req.completion_id, "object": "chat.completion.chunk", "created": req.created,
             "model": model,
             "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}
    if event is not None and req.logprobs and event.token_id is not None:
        chunk["choices"][0]["logprobs"] = _logprobs([event], decode)
    if event is not None and event.finished:
        chunk["choices"][0]["finish_reason"] = FINISH_REASONS.get(event.finish_reason or "", "stop")
        chunk["usage"] = usage(event)
    return chunk
