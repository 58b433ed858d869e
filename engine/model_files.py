"""A model folder's files read with errors that name the file.

json and safetensors report a damaged file by what they met ("Expecting value: line 1 column 1",
"Error while deserializing header: invalid header length") and not by which file it was; a
model folder holds several of each."""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any


class ModelFileError(ValueError):
    """A file of the model folder cannot be read; the message names it and says why."""


def json_problem(path: Path) -> str | None:
    """Why `path` is not valid JSON ("config.json is not valid JSON (…)"), or None."""
    try:
        json.loads(path.read_bytes())
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return _not_json(path, err)
    return None


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object `path` holds; ModelFileError naming the file otherwise."""
    try:
        value = json.loads(path.read_bytes())
    except ValueError as err:
        raise ModelFileError(f"{_not_json(path, err)}, in {path.parent}") from err
    if not isinstance(value, dict):
        raise ModelFileError(f"{path.name} in {path.parent} must hold a JSON object, not a "
                             f"{type(value).__name__}")
    return value


def open_checkpoint(path: Path) -> AbstractContextManager[Any]:
    """safetensors' safe_open for reading tensors on the CPU; ModelFileError naming the file
    when its header cannot be read (a truncated or foreign file)."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(path, framework="pt", device="cpu")
    except SafetensorError as err:
        raise ModelFileError(f"{path.name} in {path.parent} is not a readable safetensors "
                             f"file ({err})") from err


def _not_json(path: Path, err: ValueError) -> str:
    return f"{path.name} is not valid JSON ({err})"
