"""LoRA adapter calls across the core's boundary: the core answers AddAdapter / RemoveAdapter
with an AdapterReply (riding on its next CoreUpdate with the adapter list), and the caller's
side raises the engine's error again, as the same type with the same message.

The engine (LLMEngine) is not thread-safe, so callers never touch its registry: the core applies
the call between two steps, on its own thread or in its own process."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.inputs import AddAdapter, RemoveAdapter
from engine.llm_engine import LLMEngine
from engine.lora.errors import AdapterError, AdapterNotFound

logger = logging.getLogger(__name__)

# (name, folder) of every registered adapter, sorted by name: what requests may name.
AdapterList = tuple[tuple[str, str], ...]

# What the caller raises, by the name the reply carries (a reply crosses a pipe as plain values).
_ERRORS: dict[str, type[Exception]] = {
    "AdapterError": AdapterError, "AdapterNotFound": AdapterNotFound,
    "RuntimeError": RuntimeError,
}


@dataclass(frozen=True)
class AdapterReply:
    """The core's answer to one adapter call: error is None when it succeeded, else the name of
    the exception to raise (a key of _ERRORS) and message its text."""

    call_id: str
    error: str | None = None
    message: str = ""

    def raise_error(self) -> None:
        """Raise what the engine raised, if it did."""
        if self.error is not None:
            raise _ERRORS.get(self.error, RuntimeError)(self.message)


def adapter_list(engine: LLMEngine) -> AdapterList:
    names = engine.adapter_names()  # sorted
    return tuple((name, engine.adapter_path(name) or "") for name in names)


def answer(engine: LLMEngine, call: AddAdapter | RemoveAdapter) -> AdapterReply:
    """Apply one adapter call to the engine (on the core's thread); never raises: a refusal is
    the caller's to raise, not a reason for the core to stop."""
    try:
        if isinstance(call, AddAdapter):
            engine.add_adapter(call.name, call.path)
        else:
            engine.remove_adapter(call.name)
    except (AdapterError, AdapterNotFound, RuntimeError) as err:
        kind = next(name for name, cls in _ERRORS.items() if isinstance(err, cls))
        # KeyError's str() quotes its argument: carry the argument itself
        return AdapterReply(call.call_id, kind, str(err.args[0]) if err.args else str(err))
    except Exception as err:  # e.g. the folder could not be read: the call fails, not the core
        logger.exception("LoRA adapter call %s failed", call)
        return AdapterReply(call.call_id, "RuntimeError", f"{type(err).__name__}: {err}")
    return AdapterReply(call.call_id)
