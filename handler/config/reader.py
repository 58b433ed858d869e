"""Typed access to resolved settings: every failure is one line naming key, value, source and
what is allowed."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn, overload

from handler.config.setting import ConfigError, Setting

SIZE_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "kib": 1024,
              "mib": 1024**2, "gib": 1024**3}


class Reader:
    """Typed access to settings; every failure names key, value, source and what is allowed."""

    def __init__(self, settings: Mapping[str, Setting], model_dir: Path) -> None:
        self.settings = settings
        self.model_dir = model_dir  # keys that name files must name them inside it

    def raw(self, key: str) -> str | None:
        s = self.settings.get(key)
        return s.value.strip() if s is not None else None

    def fail(self, key: str, allowed: str) -> NoReturn:
        self.refuse(key, f"expected {allowed}")

    def refuse(self, key: str, why: str) -> NoReturn:
        """The set value of `key` is wrong for the reason `why` (which says what to do)."""
        s = self.settings[key]
        raise ConfigError(f"invalid {key}={s.value!r} (from {s.source}): {why}")

    @overload
    def integer(self, key: str, default: int, minimum: int = 1) -> int: ...
    @overload
    def integer(self, key: str, default: None, minimum: int = 1) -> int | None: ...

    def integer(self, key: str, default: int | None, minimum: int = 1) -> int | None:
        value = self.raw(key)
        if value is None:
            return default
        if not re.fullmatch(r"[+-]?\d+", value) or int(value) < minimum:
            self.fail(key, f"an integer >= {minimum}")
        return int(value)

    def number(self, key: str, default: float, low: float, high: float | None = None) -> float:
        value = self.raw(key)
        if value is None:
            return default
        try:
            number = float(value)
        except ValueError:
            number = float("nan")
        if not (number >= low and (high is None or number <= high)):
            self.fail(key, f"a number in [{low:g}, {'inf' if high is None else f'{high:g}'}]")
        return number

    def flag(self, key: str, default: bool) -> bool:
        value = self.raw(key)
        if value is None:
            return default
        if value.lower() not in ("true", "false"):
            self.fail(key, "true or false")
        return value.lower() == "true"

    def choice(self, key: str, default: str, allowed: Mapping[str, str] | set[str]) -> str:
        value = self.raw(key)
        if value is None:
            return default
        if value.lower() not in allowed:
            self.fail(key, f"one of {', '.join(sorted(allowed))}")
        return allowed[value.lower()] if isinstance(allowed, Mapping) else value.lower()

    def size(self, key: str) -> int | None:
        value = self.raw(key)
        if value is None:
            return None
        size = parse_size(value)
        if size is None:
            self.fail(key, "a positive size in bytes, optionally with KiB/MiB/GiB or KB/MB/GB")
        return size


def parse_size(value: str) -> int | None:
    """`720MiB`, `1.5 GB`, `4096`… as bytes; None when it is not a positive size."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-zA-Z]*)", value.strip())
    if m is None or m.group(2).lower() not in SIZE_UNITS or float(m.group(1)) <= 0:
        return None
    return int(float(m.group(1)) * SIZE_UNITS[m.group(2).lower()])
