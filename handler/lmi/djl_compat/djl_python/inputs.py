"""Input: one request (or a batch of them) as a djl_python handler sees it."""

from __future__ import annotations

import io
import json

from .pair_list import PairList


class Input:
    """`properties`: HTTP headers and custom attributes (or, on the start-up call, the model's
    properties); `content`: the body under "data", plus any query parameters."""

    def __init__(self) -> None:
        self.function_name: str | None = None
        self.properties: dict[str, str] = {}
        self.content = PairList()

    def __str__(self) -> str:
        return f"properties: {self.properties}, content keys: {self.content.get_keys()}"

    # --- batches: one Input with batch_size=N and batch_NNN.-prefixed keys ---

    def is_batch(self) -> bool:
        return "batch_size" in self.properties

    def get_batch_size(self) -> int:
        return int(self.properties.get("batch_size", "1"))

    def get_batches(self) -> list[Input]:
        """Split a batch back into its requests; the index sits at key[6:9], the name after
        key[9] (so `batch_001.data` and `batch_001_data` both work)."""
        if not self.is_batch():
            return [self]
        batch = [Input() for _ in range(self.get_batch_size())]
        for key, value in self.properties.items():
            if key.startswith("batch_") and key != "batch_size":
                batch[int(key[6:9])].properties[key[10:]] = value
        for key, value in zip(self.content.get_keys(), self.content.get_values(), strict=True):
            batch[int(key[6:9])].content.add(key[10:], value)
        return batch

    # --- properties ---

    def get_function_name(self) -> str | None:
        return self.function_name

    def get_properties(self) -> dict[str, str]:
        return self.properties

    def get_property(self, key: str) -> str | None:
        """Case-insensitive, as HTTP header names are."""
        wanted = key.lower()
        return next((v for k, v in self.properties.items() if k.lower() == wanted), None)

    # --- content ---

    def get_content(self) -> PairList:
        return self.content

    def contains_key(self, key: str) -> bool:
        return self.content.get(key) is not None

    def is_empty(self) -> bool:
        return self.content.is_empty()

    def get_as_bytes(self, key: str | None = None):
        """The value under `key` (KeyError when missing), else "data", else the first."""
        if self.content.is_empty():
            return None
        if key:
            value = self.content.get(key)
            if value is None:
                raise KeyError(f"requested data for key:{key} is not found!")
            return value
        value = self.content.get("data")
        return self.content.value_at(0) if value is None else value

    def get_as_string(self, key: str | None = None) -> str:
        return bytes(self.get_as_bytes(key=key)).decode("utf-8")

    def get_as_json(self, key: str | None = None):
        return json.loads(self.get_as_string(key=key))

    def get_as_csv(self, key: str | None = None) -> list[dict]:
        import csv

        return list(csv.DictReader(io.StringIO(self.get_as_string(key=key))))

    def get_as_image(self, key: str | None = None):
        from PIL import Image  # optional, as in DJL

        return Image.open(io.BytesIO(self.get_as_bytes(key=key)))

    def get_as_npz(self, key: str | None = None) -> list:
        import numpy

        npz = numpy.load(io.BytesIO(self.get_as_bytes(key=key)))
        return [npz[name] for name in npz.files]

    def get_data(self, key: str | None = None):
        """Decoded by content-type: JSON, text, image, npz, else bytes."""
        content_type = self.get_property("content-type") or ""
        if content_type.startswith("application/json"):
            return self.get_as_json(key)
        if content_type.startswith("text/"):
            return self.get_as_string(key)
        if content_type.startswith("image/"):
            return self.get_as_image(key)
        if content_type == "tensor/npz":
            return self.get_as_npz(key)
        return None if self.content.is_empty() else self.get_as_bytes(key=key)
