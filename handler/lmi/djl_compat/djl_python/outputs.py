"""Output: what a djl_python handler returns; batchyard turns it into the HTTP answer."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable

from .pair_list import PairList

logger = logging.getLogger(__name__)


class _JSONEncoder(json.JSONEncoder):
    """numpy scalars and arrays and datetimes, as DJL encodes them."""

    def default(self, o):
        import datetime

        if isinstance(o, datetime.datetime):
            return str(o)
        for method in ("tolist", "item"):  # numpy arrays, then numpy scalars
            if hasattr(o, method):
                return getattr(o, method)()
        return super().default(o)


class Output:
    """Status code and message, properties (sent as response headers, content-type among
    them), content (one entry per request of a batch), or a stream of items."""

    def __init__(self, code: int = 200, message: str = "OK") -> None:
        self.code = code
        self.message = message
        self.properties: dict[str, str] = {}
        self.content = PairList()
        self.stream_content: Iterable | None = None
        self.stream_content_formatter: Callable | None = None
        self.finalize_function: Callable | None = None
        self.finalize_args: tuple = ()

    def __str__(self) -> str:
        return json.dumps({"code": self.code, "message": self.message,
                           "properties": self.properties,
                           "content": {str(k): str(type(v)) for k, v in
                                       zip(self.content.get_keys(), self.content.get_values(),
                                           strict=True)}}, indent=2)

    def set_code(self, code: int) -> Output:
        self.code = code
        return self

    def set_message(self, message: str) -> Output:
        self.message = message
        return self

    def error(self, error: str, code: int = 424,
              message: str = "invoke handler failure") -> Output:
        self.code, self.message = code, message
        self.add_property("content-type", "application/json")
        return self.add_as_json({"code": code, "message": message, "error": error})

    def add_property(self, key: str, val: str) -> Output:
        self.properties[key] = val
        return self

    def get_properties(self) -> dict[str, str]:
        return self.properties

    def get_property(self, key: str) -> str | None:
        wanted = key.lower()
        return next((v for k, v in self.properties.items() if k.lower() == wanted), None)

    def add(self, value, key: str | None = None, batch_index: int | None = None) -> Output:
        """str is UTF-8 encoded, bytes kept, anything else JSON-encoded; with batch_index the
        key becomes batch_{i}.{key}, the row of that request in a batch."""
        if key is not None and not isinstance(key, str):
            logger.warning("Output key should be str type, got %s", type(key))
            key = str(key)
        if batch_index is not None:
            key = f"batch_{batch_index}.{key or ''}"
        if isinstance(value, str):
            value = value.encode("utf-8")
        elif isinstance(value, bytes | bytearray):
            value = bytes(value)
        else:
            value = self._encode_json(value)
        self.content.add(key=key, value=value)
        return self

    def add_as_json(self, val, key: str | None = None, batch_index: int | None = None) -> Output:
        return self.add(self._encode_json(val), key=key, batch_index=batch_index)

    def add_as_string(self, val: str, key: str | None = None,
                      batch_index: int | None = None) -> Output:
        return self.add(str(val), key=key, batch_index=batch_index)

    def add_stream_content(self, stream_content: Iterable,
                           output_formatter: Callable | None = None) -> Output:
        """Stream the items as chunked transfer; each item goes through output_formatter when
        one is given (str/bytes kept, anything else JSON)."""
        self.stream_content = stream_content
        self.stream_content_formatter = output_formatter
        return self

    def finalize(self, function: Callable, *args) -> Output:
        """Run function(*args) once the response has been sent."""
        self.finalize_function, self.finalize_args = function, args
        return self

    @staticmethod
    def _default_stream_output_formatter(item) -> bytes:
        """DJL's default: one JSON line {"outputs": item}, or {"error_msg"} for an error."""
        body = {"error_msg": str(item)} if isinstance(item, Exception) else {"outputs": item}
        return (json.dumps(body) + "\n").encode("utf-8")

    @staticmethod
    def _encode_json(val) -> bytes:
        return json.dumps(val, ensure_ascii=False, allow_nan=False, cls=_JSONEncoder,
                          separators=(",", ":")).encode("utf-8")
