"""A handler's Output split into one Row per request of its batch, as DJL checks it: a code
>= 300 goes to every request; otherwise each content key batch_{i}.{name} belongs to request i
(code, message and properties are shared)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

_BATCH_KEY = re.compile(r"batch_(\d+)[._](.*)", re.S)


@dataclass(frozen=True)
class Row:
    """What one request gets back: no content (None returned → 204), a body, a stream or an
    error the handler raised."""

    code: int = 200
    message: str = "OK"
    properties: dict[str, str] = field(default_factory=dict)
    items: list[tuple[str | None, bytes]] = field(default_factory=list)
    stream: Iterable | None = None
    stream_formatter: Callable | None = None
    finalize: Callable[[], None] | None = None
    error: BaseException | None = None
    empty: bool = False  # the handler returned None

    @staticmethod
    def failed(err: BaseException) -> Row:
        return Row(code=424, error=err)


def split_rows(output, n: int) -> list[Row]:
    """One Row per request; a batched output that does not match the batch fails them all."""
    if output is None:
        return [Row(code=204, empty=True)] * n
    try:
        shared = _shared(output)
    except (AttributeError, TypeError) as err:
        return [Row.failed(TypeError(f"the handler returned {type(output).__name__}, not an "
                                     f"Output ({err})"))] * n
    items = list(zip(output.content.get_keys(), output.content.get_values(), strict=True))
    if n == 1 or shared.code >= 300:
        return [_row(shared, items, first=i == 0) for i in range(n)]
    if shared.stream is not None:
        return [Row.failed(ValueError("streaming is not supported for a batch"))] * n
    rows: list[list] = [[] for _ in range(n)]
    for key, value in items:
        match = _BATCH_KEY.fullmatch(key or "")
        if match is None or int(match.group(1)) >= n:
            if len(items) != n:
                return [Row.failed(ValueError(
                    f"the handler returned {len(items)} outputs for a batch of {n}; add each "
                    "with Output.add(value, batch_index=i)"))] * n
            # one unkeyed output per request, in order
            return [_row(shared, [item], first=i == 0) for i, item in enumerate(items)]
        rows[int(match.group(1))].append((match.group(2) or None, value))
    return [_row(shared, r, first=i == 0) for i, r in enumerate(rows)]


def _shared(output) -> Row:
    function = getattr(output, "finalize_function", None)
    args = getattr(output, "finalize_args", ())
    return Row(code=int(output.code), message=str(output.message),
               properties={str(k): str(v) for k, v in output.properties.items()},
               stream=getattr(output, "stream_content", None),
               stream_formatter=getattr(output, "stream_content_formatter", None),
               finalize=(lambda: function(*args)) if function is not None else None)


def _row(shared: Row, items: list, *, first: bool) -> Row:
    # finalize runs once per handler call: after the first request's answer.
    return Row(shared.code, shared.message, shared.properties,
               [(k, bytes(v)) for k, v in items], shared.stream, shared.stream_formatter,
               shared.finalize if first else None)
