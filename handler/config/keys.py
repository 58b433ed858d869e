"""Every serving.properties key, declared once: its spelling, where its value lands, its default,
its TGI/SageMaker env aliases and how it is validated. The known-keys check, the env aliases,
the reader (serving_config.py), the start-up log of resolved values and the README's
configuration table (tests/test_config_keys.py compares them) all come from KEYS, so a key cannot be
read under one name, logged under a second and documented under a third."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from engine import (
    ATTENTION_BACKENDS,
    BATCHING_STRATEGIES,
    CUDAGRAPH_MODES,
    DEVICES,
    LINEAR_BACKENDS,
    MODEL_IMPLS,
)
from handler.config import key_reads as custom
from handler.config.reader import Reader

Read = Callable[[Reader, "Key"], Any]
Check = Callable[[Reader, Mapping[str, Any]], None]

PAGED_VALUES = custom.PAGED_VALUES
ROLLING_VALUES = frozenset({"disable", "auto", "scheduler"}) | PAGED_VALUES
DTYPES = {"auto": "auto", "fp32": "float32", "float32": "float32", "fp16": "float16",
          "float16": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16"}


@dataclass(frozen=True)
class Key:
    """One key. `fields` name where its value lands in ServingConfig: `engine.x` (EngineConfig),
    `lmi.x` (LmiOptions) or `x`, under the same name all the way to the code that uses it; ()
    for the keys that only choose the strategy."""

    name: str  # the canonical spelling: `option.x`, or bare for DJL's model-server keys
    fields: tuple[str, ...]
    default: Any  # the value when no source sets the key
    read: Read  # → the value (default when unset); a bad one raises a one-line ConfigError
    env: tuple[str, ...] = ()  # TGI/SageMaker variables standing for its OPTION_/SERVING_ one
    check: Check | None = None  # a rule spanning keys, run once every key is read
    logged: frozenset[str] = frozenset()  # strategies whose start-up line always shows it
    bare: bool = False  # also accepted without `option.` (the rolling-batch keys)

    @property
    def env_var(self) -> str:
        """LMI's variable for the key: OPTION_<KEY> for option.* keys, else SERVING_<KEY>."""
        bare = self.name.removeprefix("option.")
        return f"{'OPTION' if bare != self.name else 'SERVING'}_{bare.upper()}"


def integer(minimum: int = 1) -> Read:
    return lambda r, key: r.integer(key.name, key.default, minimum)


def number(low: float, high: float | None = None) -> Read:
    return lambda r, key: r.number(key.name, key.default, low, high)


def choice(allowed: Mapping[str, str] | Iterable[str]) -> Read:
    values = allowed if isinstance(allowed, Mapping) else set(allowed)
    return lambda r, key: r.choice(key.name, key.default, values)


def flag(r: Reader, key: Key) -> bool:
    return r.flag(key.name, key.default)


def size(r: Reader, key: Key) -> int | None:
    value = r.size(key.name)
    return key.default if value is None else value


def text(r: Reader, key: Key) -> str | None:
    return r.raw(key.name) or key.default


ALL, PAGED = frozenset(BATCHING_STRATEGIES), frozenset({"paged"})
KEYS: tuple[Key, ...] = (
    # DJL's model-server keys (no `option.` prefix)
    Key("batch_size", ("lmi.batch_size",), 1, integer(), check=custom.one_batching),
    Key("max_batch_delay", ("engine.max_batch_delay_ms", "lmi.max_batch_delay_ms"), 100.0,
        number(0.0), logged=frozenset({"dynamic"})),
    Key("job_queue_size", ("job_queue_size",), 1000, integer(0),
        env=("MAX_CONCURRENT_REQUESTS",), logged=ALL),
    Key("maxWorkers", ("lmi.max_workers",), 1, custom.max_workers),
    # rolling batching; the strategy also sets engine.max_num_seqs to 1 (none) or batch_size
    Key("option.rolling_batch", (), "disable", choice(ROLLING_VALUES), bare=True),
    Key("option.paged_attention", (), True, flag),  # lmi-dist=false: continuous batching
    Key("option.max_rolling_batch_size", ("engine.max_num_seqs",), 32, integer(),
        env=("MAX_BATCH_SIZE",), logged=ALL, bare=True),
    Key("option.max_rolling_batch_prefill_tokens", ("engine.max_num_batched_tokens",), None,
        integer(), env=("MAX_BATCH_PREFILL_TOKENS",), logged=frozenset({"continuous", "paged"}),
        bare=True),
    # the model and how it runs
    Key("option.model_id", ("model_id",), None, text, env=("HF_MODEL_ID",)),
    Key("option.dtype", ("engine.dtype",), "auto", choice(DTYPES), logged=ALL),
    Key("option.device", ("engine.device",), "auto", choice(DEVICES), logged=ALL),
    Key("option.max_model_len", ("engine.max_model_len",), None, integer(2), logged=ALL),
    Key("option.tensor_parallel_degree", ("engine.tensor_parallel_size",), 1,
        custom.tensor_parallel, env=("SM_NUM_GPUS",)),
    Key("option.trust_remote_code", ("engine.trust_remote_code",), False, flag,
        env=("HF_MODEL_TRUST_REMOTE_CODE",)),
    Key("option.model_impl", ("engine.model_impl",), "auto", choice(MODEL_IMPLS)),
    Key("option.quantize", ("engine.quantize",), None, custom.quantize,
        env=("HF_MODEL_QUANTIZE",)),
    Key("option.seed", ("engine.seed",), 0, integer(0)),
    # LoRA adapters (<model dir>/adapters/<name>/ are added at start-up: serving_config.py)
    Key("option.enable_lora", ("engine.enable_lora",), False, custom.enable_lora),
    Key("option.max_loras", ("engine.max_loras",), 4, integer()),
    Key("option.max_lora_rank", ("engine.max_lora_rank",), 16, custom.lora_rank),
    Key("option.max_cpu_loras", ("engine.max_cpu_loras",), None, integer(),
        check=custom.lora_limits),
    Key("option.lora_modules", ("engine.lora_modules",), (), custom.lora_modules,
        env=("LORA_ADAPTERS",)),
    # speculative decoding (engine/spec/): LMI's keys, or vLLM's JSON over them
    Key("option.speculative_draft_model", (), None, custom.speculative_draft_model),
    Key("option.speculative_length", ("engine.num_speculative_tokens",), 5, integer()),
    Key("option.speculative_disable_batch_size", ("engine.speculative_disable_batch_size",),
        None, integer()),
    Key("option.speculative_config", (), None, custom.speculative_config),
    # disaggregated prefill and decode (engine/disagg/): vLLM's kv_transfer_config turns it on
    Key("option.kv_transfer_config", (), None, custom.kv_transfer_config,
        check=custom.disaggregation_fits),
    Key("option.num_prefill_workers", (), 1, integer()),
    Key("option.num_decode_workers", (), 1, integer()),
    Key("option.cooperative_prefill_threshold", (), 2048, integer(0)),
    # paged batching and the KV pool
    Key("option.block_size", ("engine.block_size",), 16, integer(), logged=PAGED),
    Key("option.enable_chunked_prefill", ("engine.enable_chunked_prefill",), True, flag,
        logged=PAGED),
    Key("option.enable_prefix_caching", ("engine.enable_prefix_caching",), False, flag,
        logged=PAGED),
    Key("option.kv_cache_memory", ("engine.kv_cache_memory",), None, size),
    Key("option.num_kv_blocks", ("engine.num_kv_blocks",), None, integer()),
    Key("option.gpu_memory_utilization", ("engine.gpu_memory_utilization",), 0.9,
        number(0.01, 1.0), env=("CUDA_MEMORY_FRACTION",)),
    # kernels, graphs and step pipelining
    Key("option.attention_backend", ("engine.attention_backend",), "auto",
        choice(ATTENTION_BACKENDS)),
    Key("option.linear_backend", ("engine.linear_backend",), "auto", choice(LINEAR_BACKENDS)),
    Key("option.enforce_eager", ("engine.enforce_eager",), False, flag),
    Key("option.cudagraph_mode", ("engine.cudagraph_mode",), "full_and_piecewise",
        choice(CUDAGRAPH_MODES)),
    Key("option.async_scheduling", ("engine.async_scheduling",), None, custom.async_scheduling),
    # processes and the HTTP edge
    Key("option.engine_process", ("engine_process",), True, flag, logged=ALL),
    Key("option.api_server_count", ("api_server_count",), 1, custom.api_server_count,
        check=custom.api_servers_share_a_core),
    Key("option.api_server_nice", ("api_server_nice",), None, custom.api_server_nice,
        check=custom.nice_needs_a_core_process),
    Key("option.predict_timeout", ("predict_timeout",), 120.0, number(0.001),
        env=("SAGEMAKER_MODEL_SERVER_TIMEOUT_SECONDS",), logged=ALL),
    Key("option.drain_timeout", ("drain_timeout",), 30.0, number(0.0, 3600.0), logged=ALL),
    # 6 MiB: SageMaker's InvokeEndpoint body limit
    Key("option.max_request_size", ("max_request_bytes",), 6 * 1024 * 1024, size),
    # LMI's migration keys: a custom djl_python handler, or formatters around the engine
    Key("option.entryPoint", ("lmi.entry_point",), None, custom.entry_point,
        env=("DJL_ENTRY_POINT",)),
    Key("option.handler", ("lmi.handler",), "handle", custom.handler_function),
    Key("option.input_formatter", ("lmi.input_formatter",), "json", custom.input_formatter),
    Key("option.output_formatter", ("lmi.output_formatter",), "json", custom.output_formatter),
    Key("option.tgi_compat", ("lmi.tgi_compat",), False, flag),
)
BY_NAME: dict[str, Key] = {key.name: key for key in KEYS}
# TGI / SageMaker variable → the LMI variable it stands for (used only when that one is unset).
ENV_ALIASES: dict[str, str] = {alias: key.env_var for key in KEYS for alias in key.env}


def read_keys(r: Reader) -> dict[str, Any]:
    """Every key's value by name, each validated, then the rules spanning keys; raises
    ConfigError on the first bad one."""
    values = {key.name: key.read(r, key) for key in KEYS}
    for key in KEYS:
        if key.check is not None:
            key.check(r, values)
    return values


def values_of(values: Mapping[str, Any], owner: str) -> dict[str, Any]:
    """{field: value} for the fields under `owner` ("engine", "lmi", or "" for ServingConfig)."""
    found = {}
    for key in KEYS:
        for path in key.fields:
            where, _, name = path.rpartition(".")
            if where == owner:
                found[name] = values[key.name]
    return found
