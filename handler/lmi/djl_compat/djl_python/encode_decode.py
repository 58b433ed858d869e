"""decode(inputs, content_type) → the request as a dict; encode(outputs, prediction,
content_type) → the answer added to an Output, as DJL's default handlers do."""

from __future__ import annotations

import csv
import io

from .inputs import Input
from .outputs import Output


def decode(inputs: Input, content_type: str | None, key: str | None = None,
           require_csv_headers: bool = True):
    """No content-type: JSON (an empty body is {"inputs": ""}); text/plain: {"inputs": [text]};
    text/csv with an inputs column; images, audio, npz and other bytes under "inputs"."""
    if not content_type:
        return inputs.get_as_json(key=key) if inputs.get_as_bytes(key=key) else {"inputs": ""}
    if "application/json" in content_type:
        return inputs.get_as_json(key=key)
    if "text/csv" in content_type:
        return _decode_csv(inputs.get_as_string(key=key), require_csv_headers)
    if "text/plain" in content_type:
        return {"inputs": [inputs.get_as_string(key=key)]}
    if content_type.startswith("image/"):
        return {"inputs": inputs.get_as_image(key=key)}
    if "tensor/npz" in content_type:
        return {"inputs": inputs.get_as_npz(key=key)}
    if content_type == "application/x-www-form-urlencoded":
        return {"inputs": inputs.get_as_string(key=key)}
    return {"inputs": inputs.get_as_bytes(key=key)}


def encode(outputs: Output, prediction, content_type: str | None, key: str | None = None,
           batch_index: int | None = None) -> None:
    """JSON unless text/csv is asked for; sets the Content-Type property."""
    if content_type and "text/csv" in content_type:
        outputs.add_as_string(_encode_csv(prediction), key=key, batch_index=batch_index)
        outputs.add_property("Content-Type", "text/csv")
        return
    outputs.add_as_json(prediction, key=key, batch_index=batch_index)
    outputs.add_property("Content-Type", "application/json")


def _decode_csv(text: str, require_headers: bool) -> dict:
    header = text.splitlines()[0].lower() if text else ""
    if require_headers and not any(h in header for h in ("question", "context", "inputs")):
        raise ValueError("a CSV body needs a header row with an inputs, question or context "
                         "column")
    rows = list(csv.DictReader(io.StringIO(text)))
    if rows and "inputs" in rows[0]:
        return {"inputs": [row["inputs"] for row in rows]}
    return {"inputs": rows}


def _encode_csv(content) -> str:
    rows = content if isinstance(content, list) else list(content)
    stream = io.StringIO()
    writer = csv.DictWriter(stream, rows[0].keys())
    writer.writeheader()
    writer.writerows(rows)
    return stream.getvalue()
