"""Request JSON → validated generation requests, and the LMI-shaped response objects."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from reprlib import Repr
from typing import Any

from flask import has_request_context, request

from engine import MAX_TOP_LOGPROBS, RequestError, SamplingParams, TokenEvent
from handler.http.structured import GUIDED_FIELDS, structured_spec

MAX_LIST_INPUTS = 64
GENERATE_FIELDS = {"inputs", "parameters", "stream", "adapters"}  # LMI's and TGI's body
Decode = Callable[[list[int]], str]
# json.dumps(text) for a str, without json.dumps's two Python calls around it: the same C
# function makes the same text (ensure_ascii, as json.dumps by default)
json_string = json.encoder.encode_basestring_ascii
FINISH_REASONS = {"length", "eos_token", "stop_sequence"}


class HTTPError(Exception):
    """An error answer: status code, a stable type name and a message naming field and limit."""

    def __init__(self, code: int, type_: str, message: str,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.code, self.type, self.message = code, type_, message
        self.headers = headers or {}
        self.counted = False  # already in the request metrics (it ended a generation)

    def body(self) -> dict:
        return {"code": self.code, "type": self.type, "message": self.message}


def bad_request(message: str) -> HTTPError:
    return HTTPError(400, "BadRequest", message)


def unknown_adapter(name: str | None, message: str) -> HTTPError:
    """A request naming an adapter that is not registered: OpenAI's routes answer as vLLM does
    for an unknown model (404), the others as LMI (424); never the base model instead."""
    if has_request_context() and request.path.startswith("/v1/"):
        shown = f"The model `{_shown_name(name)}` does not exist." if name is not None else message
        return HTTPError(404, "NotFoundError", shown)
    shown = f"Adapter {_shown_name(name)} is not registered" if name is not None else message
    return HTTPError(424, "AdapterNotRegistered", shown)


def _shown_name(name: str) -> str:
    return name if len(name) <= 128 else name[:125] + "..."


_REPR = Repr()  # keyword arguments need Python 3.12
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict = 3, 60, 60, 4, 4
# name → (accepted JSON types, description used in errors)
_PARAMETERS: dict[str, tuple[tuple[type, ...], str]] = {
    "max_new_tokens": ((int,), "an integer"), "min_new_tokens": ((int,), "an integer"),
    "do_sample": ((bool,), "a boolean"), "temperature": ((int, float), "a number"),
    "top_k": ((int,), "an integer"), "top_p": ((int, float), "a number"),
    "repetition_penalty": ((int, float), "a number"), "seed": ((int,), "an integer"),
    "frequency_penalty": ((int, float), "a number"),
    "presence_penalty": ((int, float), "a number"),
    "stop_sequences": ((list, str), "a list of strings"),
    "stop": ((list, str), "a list of strings"),
    "ignore_eos_token": ((bool,), "a boolean"), "ignore_eos": ((bool,), "a boolean"),
    "return_full_text": ((bool,), "a boolean"), "details": ((bool,), "a boolean"),
    # TGI's request extras
    "decoder_input_details": ((bool,), "a boolean"), "top_n_tokens": ((int,), "an integer"),
    "truncate": ((int, type(None)), "an integer or null"), "watermark": ((bool,), "a boolean"),
    "adapter_id": ((str, type(None)), "an adapter name"),  # TGI's LoRA adapter
}
_GRAMMAR_PARAMETERS = ("grammar", *GUIDED_FIELDS)  # handler/http/structured.py reads them
# Read here, not by SamplingParams.
_EDGE_PARAMETERS = {"details", "return_full_text", "decoder_input_details", "top_n_tokens",
                    "truncate", "watermark", "adapter_id"}


@dataclass(frozen=True)
class GenerateRequest:
    """A parsed /invocations body in the LMI schema."""

    inputs: tuple[str, ...]
    is_list: bool
    params: SamplingParams
    stream: bool
    details: bool
    return_full_text: bool
    decoder_input_details: bool = False  # details.prefill: the prompt's tokens
    top_n_tokens: int = 0  # details.top_tokens: the most likely alternatives of each token
    truncate: int | None = None  # keep only the prompt's last N tokens
    adapters: tuple[str | None, ...] = ()  # each input's LoRA adapter (None: the base model)


def parse_generate(body: dict, *, wants_stream: bool,
                   details_default: bool = False) -> GenerateRequest:
    """Validate `{"inputs", "parameters", "stream"}`; raises HTTPError 400 naming the field."""
    unknown = sorted(set(body) - GENERATE_FIELDS)
    if unknown:  # refused rather than silently ignored
        raise bad_request(f"unknown top-level fields: {', '.join(map(_shown, unknown))}; "
                          f"supported: {', '.join(sorted(GENERATE_FIELDS))} (or messages "
                          "for chat)")
    inputs: Any = body.get("inputs")  # any JSON value
    is_list = isinstance(inputs, list)
    items = inputs if is_list else [inputs]
    if inputs is None:
        raise bad_request("field inputs is required (a string or a list of strings)")
    if not items or len(items) > MAX_LIST_INPUTS:
        raise bad_request(f"inputs must hold 1 to {MAX_LIST_INPUTS} items (given: {len(items)})")
    if not all(isinstance(s, str) and s for s in items):
        raise bad_request("inputs must be a non-empty string or a list of non-empty strings")
    parameters = body.get("parameters", {})
    if not isinstance(parameters, dict):
        raise bad_request("parameters must be a JSON object")
    stream = body.get("stream", wants_stream)
    if not isinstance(stream, bool):
        raise bad_request("stream must be a boolean")
    if stream and is_list:
        raise bad_request("stream supports a single input, not a list of inputs")
    top_n, truncate, prefill = _tgi_extras(parameters, stream)
    constrained = {k: parameters[k] for k in _GRAMMAR_PARAMETERS if k in parameters}
    params = sampling_params({k: v for k, v in parameters.items()
                              if k not in _EDGE_PARAMETERS and k not in constrained}, top_n)
    try:  # TGI's grammar, or vLLM's guided_* names
        params = replace(params, guided=structured_spec(constrained, "parameters."))
    except RequestError as err:
        raise bad_request(str(err)) from err
    adapters = lmi_adapters(body.get("adapters", parameters.get("adapter_id")), len(items))
    return GenerateRequest(tuple(items), is_list, params, stream,
                           parameters.get("details", details_default) or prefill,
                           _flag(parameters, "return_full_text"), prefill, top_n, truncate,
                           adapters)


def lmi_adapters(value: Any, count: int) -> tuple[str | None, ...]:
    """LMI's "adapters" (or TGI's parameters.adapter_id): one name for every input, or a
    list as long as a list of inputs; "" or null is the base model."""
    if value is None or isinstance(value, str):
        return (value or None,) * count
    if not isinstance(value, list) or not all(v is None or isinstance(v, str) for v in value):
        raise bad_request("adapters must be an adapter name or a list of them (\"\" for the "
                          "base model)")
    if len(value) != count:
        raise bad_request(f"Number of adapters ({len(value)}) is not equal to the number of "
                          f"inputs ({count})")
    return tuple(v or None for v in value)


def _tgi_extras(p: dict, stream: bool) -> tuple[int, int | None, bool]:
    """(top_n_tokens, truncate, decoder_input_details), checked as TGI checks them."""
    _check_types({k: v for k, v in p.items() if k in _EDGE_PARAMETERS})
    if p.get("watermark"):
        raise bad_request("parameters.watermark is not supported (given: true); remove it or "
                          "set it to false")
    top_n, truncate = p.get("top_n_tokens", 0), p.get("truncate")
    if not 0 <= top_n <= MAX_TOP_LOGPROBS:
        raise bad_request(f"parameters.top_n_tokens must be between 0 and {MAX_TOP_LOGPROBS} "
                          f"(given: {top_n})")
    if truncate is not None and truncate < 1:
        raise bad_request(f"parameters.truncate must be >= 1 (given: {truncate})")
    prefill = bool(p.get("decoder_input_details", False))
    if prefill and stream:
        raise bad_request("parameters.decoder_input_details is not supported when streaming")
    return top_n, truncate, prefill

def sampling_params(parameters: dict, top_logprobs: int = 0) -> SamplingParams:
    """LMI/TGI parameter names → SamplingParams; unknown names and wrong types are errors."""
    unknown = sorted(set(parameters) - set(_PARAMETERS))
    if unknown:
        raise bad_request(f"unknown parameters: {', '.join(map(_shown, unknown))}; supported: "
                          f"{', '.join(sorted(_PARAMETERS))}")
    _check_types(parameters)
    p = parameters
    stop = p.get("stop_sequences", p.get("stop", []))
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise bad_request("parameters.stop_sequences must be a list of strings")
    do_sample = p.get("do_sample", _sampling_inferred(p))
    try:
        return SamplingParams(
            max_new_tokens=p.get("max_new_tokens", 30), min_new_tokens=p.get("min_new_tokens", 0),
            do_sample=do_sample, temperature=float(p.get("temperature", 1.0)),
            top_k=p.get("top_k", 0), top_p=float(p.get("top_p", 1.0)),
            repetition_penalty=float(p.get("repetition_penalty", 1.0)), seed=p.get("seed"),
            frequency_penalty=float(p.get("frequency_penalty", 0.0)),
            presence_penalty=float(p.get("presence_penalty", 0.0)),
            stop=tuple(stop), ignore_eos=p.get("ignore_eos_token", p.get("ignore_eos", False)),
            top_logprobs=top_logprobs)
    except RequestError as err:
        raise bad_request(str(err)) from err


def _check_types(parameters: dict) -> None:
    for name, value in parameters.items():
        types, described = _PARAMETERS[name]
        is_bool = isinstance(value, bool)
        if not isinstance(value, types) or (is_bool and bool not in types):
            raise bad_request(f"parameters.{name} must be {described} (given: {_shown(value)})")


def _shown(value: object) -> str:
    """A client's value in an error message: bounded in length and depth (reprlib)."""
    return _REPR.repr(value)


def _sampling_inferred(p: dict) -> bool:
    """LMI >= 0.32 and vLLM: sampling when a knob asks for it; temperature 0 means greedy."""
    if p.get("temperature") == 0:
        return False
    return (p.get("temperature", 1.0) != 1.0 or p.get("top_k", 0) > 0
            or p.get("top_p", 1.0) < 1.0)


def _flag(parameters: dict, name: str) -> bool:
    return bool(parameters.get(name, False))


def token_dict(event: TokenEvent) -> dict:
    return {"id": event.token_id, "text": event.text, "log_prob": event.logprob}


def token_line(event: TokenEvent) -> str | None:
    """json.dumps({"token": token_dict(event)}) without the dicts (a stream writes one per
    token, the output thread one per token of every stream); None where json.dumps would
    write something else (a log-prob that is not a finite float)."""
    token_id, text, logprob = event.token_id, event.text, event.logprob
    if type(token_id) is not int or type(text) is not str:
        return None
    if logprob is None:
        number = "null"
    elif type(logprob) is float and math.isfinite(logprob):
        number = repr(logprob)  # as json.dumps writes a float
    else:
        return None
    return f'{{"token": {{"id": {token_id}, "text": {json_string(text)}, "log_prob": {number}}}}}'


def framed(body: str, sse: bool) -> str:
    """A line's JSON as a stream carries it: an SSE event, or one JSON line."""
    return f"data: {body}\n\n" if sse else body + "\n"


PROBE = "\x00batchyard-text\x00"  # a string no chunk holds


def around_probe(chunk: dict) -> tuple[str, str] | None:
    """json.dumps(chunk) before and after the one string that is PROBE: a stream whose
    per-token chunks differ only in that string makes each as before + json.dumps(text) +
    after, json.dumps's own text (~3x sooner). None if PROBE is not there exactly once."""
    parts = json.dumps(chunk).split(json.dumps(PROBE))
    return (parts[0], parts[1]) if len(parts) == 2 else None


def fill_probe(around: tuple[str, str], text: str) -> str:
    """The chunk's JSON with `text` where around_probe found PROBE."""
    return f"{around[0]}{json_string(text)}{around[1]}"


def details_dict(events: list[TokenEvent], *, with_tokens: bool) -> dict:
    last = events[-1]
    details: dict[str, Any] = {"finish_reason": last.finish_reason,
                               "generated_tokens": last.num_output_tokens,
                               "inputs": last.num_prompt_tokens}
    if with_tokens:
        details["tokens"] = [token_dict(e) for e in events if e.token_id is not None]
    return details


def generation_dict(events: list[TokenEvent], prompt: str, request: GenerateRequest, *,
                    decode: Decode | None = None, prompt_ids: Sequence[int] = ()) -> dict:
    """The non-streaming answer for one input: generated_text (+ details)."""
    text = "".join(e.text for e in events)
    result: dict = {"generated_text": prompt + text if request.return_full_text else text}
    if request.details:
        details = details_dict(events, with_tokens=True)
        if request.top_n_tokens and decode is not None:
            details["top_tokens"] = [top_tokens(e, decode) for e in events
                                     if e.token_id is not None]
        if request.decoder_input_details and decode is not None:
            # Prompt log-probs are not computed by the engine: reported as null.
            details["prefill"] = [{"id": i, "text": decode([i]), "log_prob": None}
                                  for i in prompt_ids]
        result["details"] = details
    return result


def top_tokens(event: TokenEvent, decode: Decode) -> list[dict]:
    return [{"id": i, "text": decode([i]), "log_prob": lp} for i, lp in event.top_logprobs]


def final_error(event: TokenEvent) -> HTTPError | None:
    """The HTTP error a request's final event stands for, if it did not end normally."""
    if event.finish_reason in FINISH_REASONS:
        return None
    if event.finish_reason == "timeout":
        return HTTPError(504, "TimeoutError", "request exceeded option.predict_timeout")
    if event.finish_reason == "abort":
        return HTTPError(503, "ServiceUnavailable", "request aborted: the server is shutting down")
    if event.finish_reason == "invalid":  # the request's grammar failed: its message names it
        return bad_request(event.error or "the request's grammar failed while generating")
    if event.finish_reason == "unknown_adapter":  # removed between submit and the engine
        # (a fixed message: the engine's names the other adapters registered)
        return unknown_adapter(None, "the request's adapter is not registered")
    return HTTPError(500, "InternalServerError", "internal error while generating; see server logs")
