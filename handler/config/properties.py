"""serving.properties + environment → ServingConfig, read once at start-up.

Precedence, lowest first: built-in defaults < SERVING_* env < OPTION_* env and the TGI/SageMaker
aliases < serving.properties (LMI applies env with put-if-absent, so the file wins).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path

from handler.config.key_policy import POLICY_KEYS
from handler.config.keys import ENV_ALIASES, KEYS
from handler.config.setting import ConfigError, Setting

logger = logging.getLogger(__name__)

# The spellings canonical_key accepts, all from the key table (handler/config/keys.py):
# DJL's model-server keys have no `option.` prefix; the rolling-batch keys may drop it.
SERVER_KEYS = frozenset(k.name for k in KEYS if not k.name.startswith("option."))
ROLLING_KEYS = frozenset(k.name.removeprefix("option.") for k in KEYS if k.bare)
ENGINE_KEYS = frozenset(k.name.removeprefix("option.") for k in KEYS
                        if k.name.startswith("option."))
# LMI's camelCase keys; env names arrive lower-cased (OPTION_ENTRYPOINT → option.entrypoint).
CAMEL_CASE = {bare.lower(): bare for bare in (k.removeprefix("option.") for k in (
    *(key.name for key in KEYS), *POLICY_KEYS)) if bare != bare.lower()}


def canonical_key(key: str) -> str:
    """`option.x` for engine keys (un-prefixed rolling keys accepted), bare server keys."""
    bare = key.removeprefix("option.")
    bare = CAMEL_CASE.get(bare.lower(), bare)
    if bare in SERVER_KEYS:
        return bare
    if bare in ENGINE_KEYS and (key.startswith("option.") or bare in ROLLING_KEYS):
        return f"option.{bare}"
    return bare if bare in CAMEL_CASE.values() else key


def parse_properties(text: str, origin: str) -> dict[str, Setting]:
    """Java-properties syntax: k=v, k = v, k: v, k v; # and ! comments; backslash continues."""
    settings: dict[str, Setting] = {}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        start = i
        line = lines[i].lstrip()
        while _continues(line) and i + 1 < len(lines):
            i += 1
            line = line[:-1] + lines[i].lstrip()
        i += 1
        if not line or line[0] in "#!":
            continue
        match = re.match(r"((?:[^\s=:\\]|\\.)+)\s*[=:\s]?\s*(.*)$", line)
        if match is None:
            continue
        key, value = _unescape(match.group(1)), _unescape(match.group(2).rstrip())
        settings[canonical_key(key)] = Setting(value, f"{origin} line {start + 1}")
    return settings


def read_properties(path: Path) -> dict[str, Setting]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"cannot read properties file {path}: {err.strerror}") from err
    except UnicodeDecodeError as err:
        raise ConfigError(f"cannot read properties file {path}: not UTF-8 text (byte "
                          f"0x{err.object[err.start]:02x} at offset {err.start}); is it a "
                          "binary file?") from err
    if "\x00" in text:  # valid UTF-8 can still be binary; NUL never belongs in a key=value
        raise ConfigError(f"cannot read properties file {path}: it holds NUL bytes (offset "
                          f"{text.index(chr(0))}); is it a binary file?")
    return parse_properties(text, str(path))


def env_settings(environ: Mapping[str, str]) -> dict[str, Setting]:
    """SERVING_* first, then OPTION_* and the aliases on top (aliases only fill unset LMI vars)."""
    env = dict(environ)
    for alias, lmi in ENV_ALIASES.items():
        if alias in env and lmi not in env:
            env[lmi] = env[alias]
            env[f"__source_{lmi}"] = alias
    settings: dict[str, Setting] = {}
    for prefix, to_key in (("SERVING_", lambda s: s), ("OPTION_", lambda s: f"option.{s}")):
        for name, value in env.items():
            if name.startswith(prefix) and not name.startswith("__"):
                key = canonical_key(to_key(name[len(prefix):].lower()))
                settings[key] = Setting(value, f"env {env.get(f'__source_{name}', name)}")
    return settings


def collect_settings(properties_path: Path | None,
                     environ: Mapping[str, str]) -> dict[str, Setting]:
    """Every source merged by precedence; the properties file (if any) wins."""
    settings = env_settings(environ)
    if properties_path is not None:
        settings.update(read_properties(properties_path))
    return settings


def model_id_setting(settings: Mapping[str, Setting]) -> str | None:
    setting = settings.get("option.model_id")
    return setting.value.strip() if setting and setting.value.strip() else None


def _continues(line: str) -> bool:
    # An odd number of trailing backslashes continues the line.
    return (len(line) - len(line.rstrip("\\"))) % 2 == 1


def _unescape(text: str) -> str:
    table = {"t": "\t", "n": "\n", "r": "\r", "f": "\f"}
    return re.sub(r"\\(.)", lambda m: table.get(m.group(1), m.group(1)), text)
