"""Which LoRA adapter a request names: SageMaker's header (which overrides the body, as LMI
does), LMI's "adapters" / TGI's parameters.adapter_id (parsed in schemas.py), or OpenAI's
`model`. The engine refuses a name that is not registered (UnknownAdapter): 424 on LMI's
routes, 404 on OpenAI's (schemas.unknown_adapter); nothing falls back to the base model."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import replace

from flask import request

from engine import RequestHandle, SamplingParams
from handler.http.choices import HandleGroup
from handler.http.schemas import unknown_adapter
from handler.http.state import ServerState

HEADER = "X-Amzn-SageMaker-Adapter-Identifier"
# Each submitted request's adapter, for the metrics' adapter label (weak: a handle that is
# dropped takes its entry with it).
_ADAPTER_OF: weakref.WeakKeyDictionary[RequestHandle, str] = weakref.WeakKeyDictionary()


def header_adapter() -> str | None:
    """The adapter SageMaker names in the header (an adapter inference component), if any."""
    return request.headers.get(HEADER) or None


def each_adapter(adapters: Sequence[str | None]) -> tuple[str | None, ...]:
    """The body's adapters per input, or the header's for all of them."""
    named = header_adapter()
    return tuple(named for _ in adapters) if named is not None else tuple(adapters)


def openai_adapter(state: ServerState, model: object) -> str | None:
    """OpenAI's `model`: the base model's name (or none) → None; a registered adapter → its
    name; anything else → 404, as vLLM. With LoRA off, `model` is not read (as before)."""
    named = header_adapter()
    if named is not None:
        return named
    engine = state.engine
    if not engine.lora_enabled or not isinstance(model, str) or not model:
        return None
    if model in (state.model_name, state.config.model_id, state.config.engine.model):
        return None
    if not engine.has_adapter(model):
        raise unknown_adapter(model, "")
    return model


def with_adapters(params: SamplingParams | list[SamplingParams],
                  adapters: Sequence[str | None]) -> list[SamplingParams]:
    """One SamplingParams per prompt, each naming its prompt's adapter."""
    each = params if isinstance(params, list) else [params] * len(adapters)
    return [p if p.adapter == a else replace(p, adapter=a)
            for p, a in zip(each, adapters, strict=True)]


def remember(handles: Sequence[RequestHandle], params: Sequence[SamplingParams]) -> None:
    for handle, p in zip(handles, params, strict=True):
        if p.adapter is not None:
            _ADAPTER_OF[handle] = p.adapter


def adapter_of(handle: RequestHandle | HandleGroup) -> str | None:
    """The adapter a request was submitted with (a group's: its first choice's)."""
    first = handle.handles[0] if isinstance(handle, HandleGroup) else handle
    return _ADAPTER_OF.get(first)
