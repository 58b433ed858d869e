"""serving.properties + environment → ServingConfig, read once at start-up.

Precedence, lowest first: built-in defaults < SERVING_* env < OPTION_* env and the TGI/SageMaker
aliases < serving.properties (LMI applies env with put-if-absent, so the file wins).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A bad setting; the message is one line naming key, value, source and what is allowed."""


@dataclass(frozen=True)
class Setting:
    value: str
    source: str  # "serving.properties line 4", "env OPTION_DTYPE", "default"


# Keys with no `option.` prefix in LMI (model-server keys).
SERVER_KEYS = {"batch_size", "max_batch_delay", "job_queue_size", "maxWorkers"}
# Rolling-batch keys also accepted without `option.`.
ROLLING_KEYS = {"rolling_batch", "max_rolling_batch_size", "max_rolling_batch_prefill_tokens"}
ENGINE_KEYS = {
    "model_id", "dtype", "max_model_len", "predict_timeout", "tensor_parallel_degree",
    "trust_remote_code", "paged_attention", "block_size", "enable_chunked_prefill",
    "enable_prefix_caching", "gpu_memory_utilization", "num_kv_blocks", "kv_cache_memory",
    "device", "max_request_size", "seed", "attention_backend", "linear_backend",
    "enforce_eager", "engine_process", "entryPoint", "handler", "input_formatter",
    "output_formatter", "tgi_compat", "quantize", "drain_timeout", "model_impl",
    "async_scheduling", "api_server_count", "api_server_nice", "cudagraph_mode",
} | ROLLING_KEYS
# LMI's camelCase keys; env names arrive lower-cased (OPTION_ENTRYPOINT → option.entrypoint).
CAMEL_CASE = {k.lower(): k for k in ("entryPoint", "maxWorkers", "minWorkers")}
# TGI / SageMaker variable → LMI variable it stands for (used only when that one is unset).
ENV_ALIASES = {
    "HF_MODEL_ID": "OPTION_MODEL_ID",
    "SM_NUM_GPUS": "OPTION_TENSOR_PARALLEL_DEGREE",
    "MAX_BATCH_SIZE": "OPTION_MAX_ROLLING_BATCH_SIZE",
    "MAX_CONCURRENT_REQUESTS": "SERVING_JOB_QUEUE_SIZE",
    "MAX_BATCH_PREFILL_TOKENS": "OPTION_MAX_ROLLING_BATCH_PREFILL_TOKENS",
    "HF_MODEL_TRUST_REMOTE_CODE": "OPTION_TRUST_REMOTE_CODE",
    "CUDA_MEMORY_FRACTION": "OPTION_GPU_MEMORY_UTILIZATION",
    "SAGEMAKER_MODEL_SERVER_TIMEOUT_SECONDS": "OPTION_PREDICT_TIMEOUT",
    "HF_MODEL_QUANTIZE": "OPTION_QUANTIZE",
    "DJL_ENTRY_POINT": "OPTION_ENTRYPOINT",
}


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
