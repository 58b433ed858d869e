"""Formatters around the built-in engine (option.input_formatter / option.output_formatter):
a built-in name, or a function of the model folder's model.py.

A custom input formatter takes the decoded JSON body and returns a body in the LMI schema
({"inputs", "parameters", "stream"}). A custom output formatter takes one LMI response object
(a whole answer, or one stream line) and returns str, bytes or a JSON-serialisable object."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from handler.http.direct_stream import LineOf
from handler.http.schemas import bad_request

BodyFn = Callable[[dict], dict]
OutputFn = Callable[[object], object]


@dataclass(frozen=True)
class Formatters:
    """The request and response shaping every strategy's answers go through."""

    output_name: str = "json"  # json | jsonlines | sse | tgi, or a model.py function's name
    output_fn: OutputFn | None = None
    input_fn: BodyFn | None = None

    def request(self, body: dict) -> dict:
        """The body as the input formatter reshapes it; its failure is the request's (400)."""
        if self.input_fn is None:
            return body
        name = getattr(self.input_fn, "__name__", "input formatter")
        try:
            shaped = self.input_fn(body)
        except Exception as err:
            raise bad_request(f"option.input_formatter {name} refused the body: "
                              f"{type(err).__name__}: {err}") from err
        if not isinstance(shaped, dict):
            raise bad_request(f"option.input_formatter {name} returned "
                              f"{type(shaped).__name__}, not a JSON object")
        return shaped

    def whole(self, payload: object) -> tuple[str | bytes, str]:
        """(body, content type) of a non-streamed answer."""
        if self.output_fn is None:
            return json.dumps(payload), "application/json"
        return _encoded(self.output_fn(payload))

    def stream(self, line_of: LineOf) -> LineOf:
        """Each stream line as the output formatter reshapes it."""
        output_fn = self.output_fn
        if output_fn is None:
            return line_of
        return lambda event: _encoded(output_fn(line_of(event)))[0]


def _encoded(value: object) -> tuple[str | bytes, str]:
    if isinstance(value, bytes | bytearray):
        return bytes(value), "application/octet-stream"
    if isinstance(value, str):
        try:
            json.loads(value)
        except ValueError:
            return value, "text/plain"
        return value, "application/json"
    return json.dumps(value), "application/json"
