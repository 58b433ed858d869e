"""OpenAI chat-completions schema on /invocations and /v1/chat/completions."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from engine import RequestError, TokenEvent
from handler.http.schemas import HTTPError, bad_request, sampling_params
from handler.http.structured import STRUCTURED_FIELDS, structured_spec
from handler.http.tools import Tools, parse_tools

_CHAT_FIELDS = {"messages", "model", "max_tokens", "max_completion_tokens", "temperature",
                "top_p", "seed", "stop", "stream", "logprobs", "top_logprobs", "n",
                "frequency_penalty", "presence_penalty", "ignore_eos", "user",
                "stream_options", "tools", "tool_choice", "parallel_tool_calls",
                *STRUCTURED_FIELDS}
MAX_CHOICES = 16  # n per request
# the body's fields that are generation parameters under the same name
OPENAI_PARAMETERS = ("temperature", "top_p", "seed", "stop", "ignore_eos", "frequency_penalty",
                     "presence_penalty")
FINISH_REASONS = {"length": "length", "eos_token": "stop", "stop_sequence": "stop"}
_TEMPLATE_ARGUMENTS = "arguments"  # templates that render calls read them as a dict


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
    tools: Tools | None = None

    @property
    def tools_for_template(self) -> list[dict] | None:
        """The tools as chat templates take them (transformers' `tools=`)."""
        if self.tools is None:
            return None
        return [{"type": "function", "function": f} for f in self.tools.functions]


def parse_chat(body: dict, *, wants_stream: bool) -> ChatRequest:
    """Validate an OpenAI chat body; unsupported options are errors, not silently ignored."""
    unknown = sorted(set(body) - _CHAT_FIELDS)
    if unknown:
        raise bad_request(f"unknown chat fields: {', '.join(unknown)}")
    messages = _messages(body["messages"])
    n = choices_asked(body, stream=body.get("stream", wants_stream))
    logprobs = body.get("logprobs", False)
    stream = body.get("stream", wants_stream)
    if not isinstance(logprobs, bool) or not isinstance(stream, bool):
        raise bad_request("logprobs and stream must be booleans")
    top_logprobs = body.get("top_logprobs") or 0
    if not isinstance(top_logprobs, int) or isinstance(top_logprobs, bool) or (
            top_logprobs and not logprobs):
        raise bad_request("top_logprobs must be an integer from 0 to 20, with logprobs true")
    parameters = {k: body[k] for k in OPENAI_PARAMETERS if body.get(k) is not None}
    # OpenAI's newer name wins when given, as before; errors then name it.
    max_field = ("max_completion_tokens" if body.get("max_completion_tokens") is not None
                 else "max_tokens")
    if body.get(max_field) is not None:
        parameters["max_new_tokens"] = body[max_field]
    try:
        params = sampling_params(parameters, top_logprobs)
    except HTTPError as err:
        raise bad_request(chat_names(err.message, max_field)) from err
    tools = _tools(body)
    spec = tools.spec() if tools is not None and tools.calls else guided(body)
    return ChatRequest(messages, replace(params, guided=spec), stream, logprobs,
                       f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), max_field,
                       include_usage({**body, "stream": stream}), n, tools)


def _messages(messages: object) -> list[dict]:
    """{role, content} each; an assistant's earlier tool calls may stand for its content."""
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise bad_request("messages must be a non-empty list of {role: str, content: str}")
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls is None and not isinstance(m.get("content"), str):
            raise bad_request(f"messages[{i}].content must be a string")
        if calls is not None:
            messages[i] = _with_calls(m, i)
    return messages


def _with_calls(message: dict, i: int) -> dict:
    """An assistant message's tool_calls, checked; arguments as a dict for the template."""
    calls = message["tool_calls"]
    content = message.get("content")
    try:
        assert message["role"] == "assistant" and isinstance(calls, list) and calls
        assert content is None or isinstance(content, str)
        shown = [{**c, "function": {**c["function"], _TEMPLATE_ARGUMENTS: json.loads(
            c["function"]["arguments"])}} for c in calls]
        assert all(isinstance(c["function"]["name"], str) for c in calls)
    except (AssertionError, KeyError, TypeError, ValueError, RecursionError) as err:
        raise bad_request(f"messages[{i}].tool_calls must be the assistant's list of "
                          '{"id", "type": "function", "function": {"name", "arguments": '
                          "JSON text}}") from err
    return {**message, "content": content or "", "tool_calls": shown}


def _tools(body: dict) -> Tools | None:
    try:
        tools = parse_tools(body)
    except RequestError as err:
        raise bad_request(str(err)) from err
    if tools is not None and tools.calls and guided(body) is not None:
        raise bad_request("tools (with tool_choice other than none) cannot be combined with "
                          "response_format or guided_* fields")
    if not isinstance(body.get("parallel_tool_calls", True), bool):
        raise bad_request("parallel_tool_calls must be a boolean")
    return tools


def guided(body: dict, prefix: str = ""):
    """The body's structured-output constraint (GuidedSpec or None); 400 naming the field."""
    try:
        return structured_spec(body, prefix)
    except RequestError as err:
        raise bad_request(str(err)) from err


def choices_asked(body: dict, *, stream: object) -> int:
    """OpenAI's `n`: 1 to MAX_CHOICES answers to one prompt, each its own sequence (a seeded
    request's choice i uses seed + i); streamed, their chunks interleave, told apart by index."""
    n = body.get("n")
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"n must be an integer from 1 to {MAX_CHOICES}")
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


def usage(last: TokenEvent | list[TokenEvent]) -> dict:
    """Token counts from the final event of each choice (n choices of one prompt: the prompt
    counts once)."""
    lasts = last if isinstance(last, list) else [last]
    prompt, completion = lasts[0].num_prompt_tokens, sum(e.num_output_tokens for e in lasts)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def chat_completion(req: ChatRequest, model: str, answers: list[list[TokenEvent]], *,
                    decode: Callable[[list[int]], str]) -> dict:
    """One choice per answer (n of them, to one prompt: its tokens are counted once)."""
    choices = [{"index": i, **_answer(req, events),
                "logprobs": _logprobs(events, decode) if req.logprobs else None}
               for i, events in enumerate(answers)]
    total = usage([events[-1] for events in answers])
    return {"id": req.completion_id, "object": "chat.completion", "created": req.created,
            "model": model, "choices": choices, "usage": total}


def _answer(req: ChatRequest, events: list[TokenEvent]) -> dict:
    """The assistant's message and finish reason: its text, or the tool call it made."""
    text = "".join(e.text for e in events)
    reason = FINISH_REASONS.get(events[-1].finish_reason or "", "stop")
    content, calls = req.tools.parse(text) if req.tools is not None else (text, [])
    message: dict = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
        reason = "tool_calls" if reason == "stop" else reason  # length: the call is cut
    return {"message": message, "finish_reason": reason}


def chat_chunk(req: ChatRequest, model: str, event: TokenEvent | None, *, first: bool,
               decode: Callable[[list[int]], str],
               tool_calls: list[dict] | None = None, index: int = 0) -> dict:
    """One streamed chunk: the role first, then content deltas; the last has finish + usage.
    With `tool_calls` (the answer is a call) the delta carries those instead of content, and
    an answer that ends well finishes as tool_calls."""
    delta: dict = {"role": "assistant", "content": None if tool_calls is not None else ""} \
        if first else {}
    if tool_calls:
        delta["tool_calls"] = tool_calls
    elif tool_calls is None and event is not None and event.text:
        delta["content"] = event.text
    chunk: dict[str, Any] = {"id": req.completion_id, "object": "chat.completion.chunk",
                             "created": req.created, "model": model,
                             "choices": [{"index": index, "delta": delta, "logprobs": None,
                                          "finish_reason": None}]}
    if event is not None and req.logprobs and event.token_id is not None:
        chunk["choices"][0]["logprobs"] = _logprobs([event], decode)
    if event is not None and event.finished:
        reason = FINISH_REASONS.get(event.finish_reason or "", "stop")
        chunk["choices"][0]["finish_reason"] = ("tool_calls" if tool_calls is not None
                                                and reason == "stop" else reason)
        if req.n == 1:  # with n choices, only stream_options' usage chunk sums them
            chunk["usage"] = usage(event)
    return chunk
