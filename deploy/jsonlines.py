"""Token streams as JSON lines, split from byte chunks: no AWS SDK needed (the benchmark's HTTP
client uses it too)."""

from __future__ import annotations

import json
from typing import Any


class StreamLineError(ValueError):
    """A stream line that is not JSON."""


class JsonLinesSplitter:
    """Bytes chunks in, JSON objects out: chunk boundaries need not match line boundaries.

    A line is decoded only once its "\\n" has arrived, so a multi-byte UTF-8 character cut by a
    chunk boundary is never decoded in halves ("\\n" never occurs inside one). SSE `data:` lines
    are accepted too.
    """

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[dict[str, Any]]:
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        return [obj for line in lines if (obj := _parse(line)) is not None]

    def close(self) -> list[dict[str, Any]]:
        """What is left after the stream ended (a last line without "\\n")."""
        line, self._buffer = self._buffer, b""
        obj = _parse(line)
        return [] if obj is None else [obj]


def _parse(line: bytes) -> dict[str, Any] | None:
    text = line.decode("utf-8").strip()
    if text.startswith("data:"):
        text = text[5:].strip()
    if not text or text == "[DONE]":
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise StreamLineError(f"the stream sent a line that is not JSON: {text[:200]!r}") from err
    return obj if isinstance(obj, dict) else {"value": obj}
