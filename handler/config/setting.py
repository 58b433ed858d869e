"""A raw setting with its source, and the error a bad one raises: the bottom of handler/config,
so that the key table, the reader and the properties parser can all name them without a cycle."""

from __future__ import annotations

from dataclasses import dataclass


class ConfigError(ValueError):
    """A bad setting; the message is one line naming key, value, source and what is allowed."""


@dataclass(frozen=True)
class Setting:
    value: str
    source: str  # "serving.properties line 4", "env OPTION_DTYPE", "default"
