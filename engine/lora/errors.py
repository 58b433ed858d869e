"""What LoRA refuses, as exceptions (no torch here: the boundary imports them)."""

from __future__ import annotations

from engine.sampling_params import RequestError


class AdapterError(ValueError):
    """An adapter batchyard refuses; the message says which and why."""


class AdapterNotFound(KeyError):
    """No adapter of that name is registered."""


class UnknownAdapter(RequestError):
    """A request names an adapter that is not registered (LMI answers 424, OpenAI's routes
    404); never served by the base model instead."""

    def __init__(self, name: str, known: list[str]) -> None:
        listed = ", ".join(known[:20]) or "none"
        super().__init__(f"adapter {name!r} is not registered (registered: {listed})",
                         "adapter")
        self.adapter = name
