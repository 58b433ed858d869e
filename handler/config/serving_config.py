"""Resolved settings → ServingConfig: every key's value from the key table (keys.py), the
strategy chosen from them, and the one start-up line that says what was resolved."""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine import NATIVE_ARCHITECTURES, EngineConfig
from handler.config import key_reads as custom
from handler.config.key_policy import POLICY_KEYS, apply_key_policy
from handler.config.keys import BY_NAME, KEYS, PAGED_VALUES, read_keys, values_of
from handler.config.lmi_options import LmiOptions
from handler.config.reader import Reader
from handler.config.setting import ConfigError, Setting
from handler.model_source.adapters import AdapterPathError, startup_adapters

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServingConfig:
    """What the server runs: the engine's config plus the HTTP edge's limits. The defaults are
    the key table's (tests/test_config_keys.py holds them equal)."""

    engine: EngineConfig
    job_queue_size: int = 1000
    predict_timeout: float = 120.0
    drain_timeout: float = 30.0  # SIGTERM: how long in-flight requests get
    max_request_bytes: int = 6 * 1024 * 1024  # SageMaker's InvokeEndpoint body limit
    engine_process: bool = True  # the engine core in a process of its own (else a thread)
    api_server_count: int = 1  # HTTP processes (gunicorn workers) sharing that core process
    api_server_nice: int | None = None  # their threads' niceness step; None: auto
    model_id: str | None = None
    strategy_reason: str = "default"
    lmi: LmiOptions = field(default_factory=LmiOptions)
    settings: Mapping[str, Setting] = field(default_factory=dict, compare=False)

    def describe(self) -> str:
        """The resolved configuration on one line, for the start-up log: the strategy, then
        each key's value under its field's name (always where the strategy uses it, else where
        it is not the default), then every key that was set, with its source."""
        e = self.engine
        parts = [f"strategy={e.batching} ({self.strategy_reason})", f"model={e.model}"]
        for key in KEYS:
            if not key.fields:
                continue
            value = self.resolved(key.fields[0])
            if e.batching in key.logged or value != key.default:
                parts.append(f"{key.fields[0].rpartition('.')[2]}={_shown(value)}")
        sources = ", ".join(f"{k}={s.value} [{s.source}]" for k, s in sorted(self.settings.items()))
        return "; ".join(parts) + (f" | from: {sources}" if sources else "")

    def resolved(self, path: str) -> Any:
        """The value at a key's field: `engine.max_num_seqs`, `lmi.handler`, `job_queue_size`."""
        value: Any = self
        for name in path.split("."):
            value = getattr(value, name)
        return value


def select_strategy(values: Mapping[str, Any], architectures: list[str]) -> tuple[str, str]:
    """(strategy, why) from rolling_batch, batch_size and the model's architecture."""
    rolling = values["option.rolling_batch"]
    why = f"option.rolling_batch={rolling}"
    if rolling == "disable":
        return ("none", "batch_size=1") if values["batch_size"] == 1 else (
            "dynamic", "batch_size > 1")
    if rolling == "scheduler":
        return "continuous", why
    if rolling == "lmi-dist" and not values["option.paged_attention"]:
        return "continuous", why + " with option.paged_attention=false"
    if rolling in PAGED_VALUES:
        return "paged", why
    # every decoder runs paged: natively, or through the transformers fallback
    if not architectures:
        return "paged", why + ": paged serves any architecture (read after the download)"
    how = ("natively" if any(a in NATIVE_ARCHITECTURES for a in architectures)
           else "through the transformers fallback")
    return "paged", why + f": paged serves {architectures[0]} {how}"


def build_serving_config(settings: Mapping[str, Setting], model_dir: Path,
                         architectures: list[str]) -> ServingConfig:
    """Validate every setting and pick the strategy; raises ConfigError on the first bad one."""
    _check_unknown(settings)
    apply_key_policy(settings)
    values = read_keys(Reader(settings, model_dir))
    strategy, why = select_strategy(values, architectures)
    engine = values_of(values, "engine")
    # max_rolling_batch_size bounds the rolling strategies; dynamic batches batch_size requests
    engine["max_num_seqs"] = {"none": 1, "dynamic": values["batch_size"]}.get(
        strategy, engine["max_num_seqs"])
    engine.update(values["option.speculative_draft_model"] or {})  # LMI's key, then vLLM's
    engine.update(values["option.speculative_config"] or {})  # JSON over it
    engine["disaggregation"] = custom.disaggregation(values)
    if engine["enable_lora"]:  # LMI's layout: <model dir>/adapters/<name>/, each by its name
        engine["lora_modules"] = _with_folder_adapters(engine["lora_modules"], model_dir)
    try:
        engine_config = EngineConfig(model=str(model_dir), batching=strategy, **engine)
    except ValueError as err:
        raise ConfigError(f"invalid resolved configuration: {err}") from err
    lmi = values_of(values, "lmi")
    if lmi["tgi_compat"] or lmi["output_formatter"] == "tgi":  # two spellings of one wish
        lmi.update(tgi_compat=True, output_formatter="tgi")
    return ServingConfig(engine=engine_config, strategy_reason=why, lmi=LmiOptions(**lmi),
                         settings=dict(settings), **values_of(values, ""))


def _with_folder_adapters(given: tuple[tuple[str, str], ...], model_dir: Path
                          ) -> tuple[tuple[str, str], ...]:
    """option.lora_modules, then the model folder's adapters (an s3:// model's are added once
    it is downloaded: handler/http/state.py); one name twice is refused."""
    try:
        found = startup_adapters(model_dir)
    except AdapterPathError as err:
        raise ConfigError(f"invalid adapter in the model folder: {err}") from err
    twice = sorted({name for name, _ in given} & {name for name, _ in found})
    if twice:
        raise ConfigError(f"invalid option.lora_modules: adapter {twice[0]!r} is also in "
                          f"{model_dir}/adapters; give each name once")
    return (*given, *found)


def _shown(value: object) -> str:
    if value is None:
        return "auto"
    return f"{value:g}" if isinstance(value, float) else str(value)


# An unknown option.* key at least this close to a known one (difflib's ratio, case ignored) is
# a typo, refused; any other is another backend's key, ignored. The closest legitimate ones
# (vLLM's speculative_model 0.85, tensor_parallel_size 0.81) stay below it, the typos of
# tests/test_properties.py (max_rolling_batchsize 0.98, max_model_length 0.90) above it.
NEAR_MISS = 0.88
# Bare policy keys left out: `option.engine` is no misspelt `engine` (DJL's key, not an option);
# the table's bare keys stay, as canonical_key reads `option.batch_size` as `batch_size`.
_KNOWN = {name.removeprefix("option.").lower(): name
          for name in (*BY_NAME, *(k for k in POLICY_KEYS if k.startswith("option.")))}


def near_miss(key: str) -> str | None:
    """The known key an unknown `option.*` key is a misspelling of, else None."""
    if not key.startswith("option."):
        return None  # DJL's bare server keys (gpu.maxWorkers, max_workers, ...) are many
    close = difflib.get_close_matches(key.removeprefix("option.").lower(), _KNOWN, n=1,
                                      cutoff=NEAR_MISS)
    return _KNOWN[close[0]] if close else None


def _check_unknown(settings: Mapping[str, Setting]) -> None:
    """A near miss of a known key fails start-up with the suggestion; every other unknown key
    (LMI files carry other backends' keys) is listed on one start-up line."""
    unknown = [(k, s) for k, s in sorted(settings.items())
               if k not in BY_NAME and k not in POLICY_KEYS]
    for key, s in unknown:
        meant = near_miss(key)
        if meant is not None:
            if s.source.startswith("env ") and meant.startswith("option."):
                meant = f"OPTION_{meant.removeprefix('option.').upper()} ({meant})"
            raise ConfigError(f"unknown key {key}={s.value!r} (from {s.source}): did you mean "
                              f"{meant}?")
    if unknown:
        # keys and sources only: another backend's key may hold a secret (option.hf_token)
        logger.warning("ignoring %d unknown key(s) that batchyard does not use (other "
                       "backends' options, or misspelt): %s", len(unknown),
                       ", ".join(f"{k} [{s.source}]" for k, s in unknown))
