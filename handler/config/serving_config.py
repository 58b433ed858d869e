"""Resolved settings → ServingConfig: strategy selection, typed values, one-line errors."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from engine import (
    ATTENTION_BACKENDS,
    CUDAGRAPH_MODES,
    DEVICES,
    LINEAR_BACKENDS,
    MODEL_IMPLS,
    NATIVE_ARCHITECTURES,
    QUANTIZATIONS,
    EngineConfig,
)
from handler.config.key_policy import POLICY_KEYS, apply_key_policy
from handler.config.lmi_options import (
    INPUT_FORMATTERS,
    MAX_WORKERS,
    OUTPUT_FORMATTERS,
    LmiOptions,
    check_entry_point,
    check_formatter,
)
from handler.config.properties import (
    ENGINE_KEYS,
    SERVER_KEYS,
    ConfigError,
    Setting,
    model_id_setting,
)
from handler.config.reader import Reader
from handler.cpu_priority import MAX_NICE

logger = logging.getLogger(__name__)

PAGED_VALUES = {"vllm", "lmi-dist", "paged"}
ROLLING_VALUES = {"disable", "auto", "scheduler"} | PAGED_VALUES
DTYPES = {"auto": "auto", "fp32": "float32", "float32": "float32", "fp16": "float16",
          "float16": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16"}
DEFAULT_MAX_REQUEST_BYTES = 6 * 1024 * 1024  # SageMaker's InvokeEndpoint body limit
DEFAULT_DRAIN_SECONDS = 30.0
MAX_API_SERVERS = 64


@dataclass(frozen=True)
class ServingConfig:
    """What the server runs: the engine's config plus the HTTP edge's limits."""

    engine: EngineConfig
    job_queue_size: int = 1000
    predict_timeout: float = 120.0
    drain_timeout: float = DEFAULT_DRAIN_SECONDS  # SIGTERM: how long in-flight requests get
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    engine_process: bool = True  # the engine core in a process of its own (else a thread)
    api_server_count: int = 1  # HTTP processes (gunicorn workers) sharing that core process
    api_server_nice: int | None = None  # their threads' niceness step; None: auto
    model_id: str | None = None
    strategy_reason: str = "default"
    lmi: LmiOptions = field(default_factory=LmiOptions)
    settings: Mapping[str, Setting] = field(default_factory=dict, compare=False)

    def describe(self) -> str:
        """The resolved configuration on one line, for the start-up log."""
        e = self.engine
        parts = [f"strategy={e.batching} ({self.strategy_reason})", f"model={e.model}",
                 f"max_num_seqs={e.max_num_seqs}", f"max_model_len={e.max_model_len or 'model'}",
                 f"dtype={e.dtype}", f"device={e.device}", f"job_queue_size={self.job_queue_size}",
                 f"predict_timeout={self.predict_timeout:g}s",
                 f"drain_timeout={self.drain_timeout:g}s",
                 f"engine_process={self.engine_process}"]
        if self.api_server_count > 1:
            parts.append(f"api_server_count={self.api_server_count}")
        if self.api_server_nice is not None:
            parts.append(f"api_server_nice={self.api_server_nice}")
        if e.quantize:
            parts.append(f"quantize={e.quantize}")
        if e.model_impl != "auto":
            parts.append(f"model_impl={e.model_impl}")
        if e.batching == "dynamic":
            parts.append(f"max_batch_delay={e.max_batch_delay_ms:g}ms")
        if e.batching == "paged":
            parts += [f"block_size={e.block_size}", f"token_budget={e.max_num_batched_tokens}",
                      f"chunked_prefill={e.enable_chunked_prefill}",
                      f"prefix_caching={e.enable_prefix_caching}"]
        sources = ", ".join(f"{k}={s.value} [{s.source}]" for k, s in sorted(self.settings.items()))
        return "; ".join(parts) + (f" | from: {sources}" if sources else "")


def select_strategy(r: Reader, batch_size: int, architectures: list[str]) -> tuple[str, str]:
    """(strategy, why) from rolling_batch, batch_size and the model's architecture."""
    rolling = r.choice("option.rolling_batch", "disable", ROLLING_VALUES)
    if rolling != "disable" and batch_size > 1:
        s = r.settings["batch_size"]
        raise ConfigError(f"invalid batch_size={s.value!r} (from {s.source}): dynamic batching "
                          f"(batch_size > 1) cannot be combined with option.rolling_batch="
                          f"{rolling}; remove one of them")
    why = f"option.rolling_batch={rolling}"
    if rolling == "disable":
        return ("none", "batch_size=1") if batch_size == 1 else ("dynamic", "batch_size > 1")
    if rolling == "scheduler":
        return "continuous", why
    if rolling == "lmi-dist" and not r.flag("option.paged_attention", True):
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
    _warn_unknown(settings)
    apply_key_policy(settings)
    r = Reader(settings)
    batch_size = r.integer("batch_size", 1)
    strategy, why = select_strategy(r, batch_size, architectures)
    max_num_seqs = {"none": 1, "dynamic": batch_size}.get(
        strategy, r.integer("option.max_rolling_batch_size", 32))
    try:
        engine = EngineConfig(
            model=str(model_dir), batching=strategy, max_num_seqs=max_num_seqs,
            max_batch_delay_ms=r.number("max_batch_delay", 100.0, 0.0),
            max_model_len=r.integer("option.max_model_len", None, 2),
            max_num_batched_tokens=r.integer("option.max_rolling_batch_prefill_tokens", None),
            dtype=r.choice("option.dtype", "auto", DTYPES),
            device=r.choice("option.device", "auto", set(DEVICES)),
            block_size=r.integer("option.block_size", 16),
            enable_chunked_prefill=r.flag("option.enable_chunked_prefill", True),
            enable_prefix_caching=r.flag("option.enable_prefix_caching", False),
            kv_cache_memory=r.size("option.kv_cache_memory"),
            num_kv_blocks=r.integer("option.num_kv_blocks", None),
            gpu_memory_utilization=r.number("option.gpu_memory_utilization", 0.9, 0.01, 1.0),
            attention_backend=r.choice("option.attention_backend", "auto",
                                       set(ATTENTION_BACKENDS)),
            linear_backend=r.choice("option.linear_backend", "auto", set(LINEAR_BACKENDS)),
            enforce_eager=r.flag("option.enforce_eager", False),
            cudagraph_mode=r.choice("option.cudagraph_mode", "full_and_piecewise",
                                    set(CUDAGRAPH_MODES)),
            async_scheduling={"auto": None, "true": True, "false": False}[
                r.choice("option.async_scheduling", "auto", {"auto", "true", "false"})],
            quantize=read_quantize(r),
            tensor_parallel_size=read_tensor_parallel(r),
            seed=r.integer("option.seed", 0, 0),
            trust_remote_code=r.flag("option.trust_remote_code", False),
            model_impl=r.choice("option.model_impl", "auto", set(MODEL_IMPLS)))
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"invalid resolved configuration: {err}") from err
    lmi = read_lmi_options(r, model_dir)
    engine_process = r.flag("option.engine_process", True)
    return ServingConfig(
        engine=engine, job_queue_size=r.integer("job_queue_size", 1000, 0),
        predict_timeout=r.number("option.predict_timeout", 120.0, 0.001),
        drain_timeout=r.number("option.drain_timeout", DEFAULT_DRAIN_SECONDS, 0.0, 3600.0),
        max_request_bytes=r.size("option.max_request_size") or DEFAULT_MAX_REQUEST_BYTES,
        engine_process=engine_process,
        api_server_count=read_api_server_count(r, engine_process, lmi),
        api_server_nice=read_api_server_nice(r, engine_process),
        model_id=model_id_setting(settings), strategy_reason=why, lmi=lmi,
        settings=dict(settings))


def read_api_server_count(r: Reader, engine_process: bool, lmi: LmiOptions) -> int:
    """HTTP processes sharing one engine core process (vLLM's --api-server-count)."""
    count = r.integer("option.api_server_count", 1)
    if count > MAX_API_SERVERS:
        r.fail("option.api_server_count", f"an integer between 1 and {MAX_API_SERVERS}")
    if count > 1 and not engine_process:
        r.fail("option.api_server_count", "1 with option.engine_process=false (several HTTP "
               "processes share the engine core only when it runs in a process of its own)")
    if count > 1 and lmi.entry_point is not None and not lmi.builtin_engine_requested:
        r.fail("option.api_server_count", "1 with a custom handler (option.entryPoint): each "
               "HTTP process would load its own copy of the handler's model")
    return count


def read_api_server_nice(r: Reader, engine_process: bool) -> int | None:
    """How far the HTTP threads step back for the engine core process (None: auto)."""
    value = r.raw("option.api_server_nice")
    if value is None or value.lower() == "auto":
        return None
    if not value.isdigit() or int(value) > MAX_NICE:
        r.fail("option.api_server_nice", f"auto or an integer between 0 and {MAX_NICE}")
    if int(value) > 0 and not engine_process:
        r.fail("option.api_server_nice", "auto or 0 with option.engine_process=false (the "
               "engine core then runs on a thread of the HTTP process and would slow down too)")
    return int(value)


def read_tensor_parallel(r: Reader) -> int:
    """N ranks, or `max` / -1 (LMI's spellings) for every visible GPU; SM_NUM_GPUS lands here."""
    value = (r.raw("option.tensor_parallel_degree") or "1").lower()
    if value in ("max", "-1"):
        return -1
    return r.integer("option.tensor_parallel_degree", 1)


def read_quantize(r: Reader) -> str | None:
    """int8 weight-only, quantized at load; LMI's checkpoint formats are refused."""
    value = (r.raw("option.quantize") or "none").lower()
    if value == "none":
        return None
    if value not in QUANTIZATIONS:
        r.fail("option.quantize", f"{' or '.join(QUANTIZATIONS)} (weight-only, quantized at "
               "load from float weights); AWQ/GPTQ/fp8/bitsandbytes checkpoints are not "
               "supported: serve fp16/bf16/fp32 weights (option.dtype)")
    return value


def read_lmi_options(r: Reader, model_dir: Path) -> LmiOptions:
    entry, handler = r.raw("option.entryPoint") or None, r.raw("option.handler") or "handle"
    if entry is not None:
        entry = check_entry_point(entry, model_dir, r.settings["option.entryPoint"].source)
    if not handler.isidentifier():
        r.fail("option.handler", "the name of a Python function")
    formatters = {}
    for key, builtins in (("option.input_formatter", INPUT_FORMATTERS),
                          ("option.output_formatter", OUTPUT_FORMATTERS)):
        value = r.raw(key)
        formatters[key] = "json" if not value else check_formatter(
            key, value, builtins, r.settings[key].source)
    tgi = r.flag("option.tgi_compat", False) or formatters["option.output_formatter"] == "tgi"
    # DJL's -1 means "as many as fit"; one call at a time is what a handler can always take.
    workers = 1 if r.raw("maxWorkers") == "-1" else r.integer("maxWorkers", 1)
    if workers > MAX_WORKERS:
        r.fail("maxWorkers", f"an integer between 1 and {MAX_WORKERS} (or -1)")
    return LmiOptions(entry_point=entry, handler=handler,
                      input_formatter=formatters["option.input_formatter"],
                      output_formatter="tgi" if tgi else formatters["option.output_formatter"],
                      tgi_compat=tgi, max_workers=workers)


def _warn_unknown(settings: Mapping[str, Setting]) -> None:
    known = SERVER_KEYS | {f"option.{k}" for k in ENGINE_KEYS} | POLICY_KEYS
    for key, s in sorted(settings.items()):
        if key not in known:
            logger.warning("unknown key %s=%s (%s) is ignored", key, s.value, s.source)
