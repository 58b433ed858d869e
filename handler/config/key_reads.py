"""The keys whose values need more than a type and a range: LMI's own spellings (`max`, `-1`),
values that name files or functions, and the rules that span keys. The key table
(handler/config/keys.py) names these functions, so each key's validation still has one home;
every failure is one line naming the key, the value, its source and what is allowed."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine import (
    KV_BUFFER_DEVICES,
    KV_CONNECTORS,
    MAX_LORA_RANKS,
    QUANTIZATIONS,
    QUANTIZE_ALIASES,
    Disaggregation,
)
from handler.config.lmi_options import (
    BUILTIN_ENTRY_POINTS,
    INPUT_FORMATTERS,
    MAX_WORKERS,
    OUTPUT_FORMATTERS,
    check_entry_point,
    check_formatter,
)
from handler.config.reader import Reader
from handler.cpu_priority import MAX_NICE

PAGED_VALUES = frozenset({"vllm", "lmi-dist", "paged"})  # option.rolling_batch's paged names

if TYPE_CHECKING:  # the table imports this module, never the other way round
    from handler.config.keys import Key

MAX_API_SERVERS = 64
# What each value of option.async_scheduling asks the engine for (None: its own choice).
ASYNC_SCHEDULING = {"auto": None, "true": True, "false": False}


def tensor_parallel(r: Reader, key: Key) -> int:
    """N ranks, or `max` / -1 (LMI's spellings) for every visible GPU; SM_NUM_GPUS lands here."""
    if (r.raw(key.name) or "").lower() in ("max", "-1"):
        return -1
    return r.integer(key.name, key.default)


def quantize(r: Reader, key: Key) -> str | None:
    """int8 / fp8 quantized at load, or the format of a pre-quantized checkpoint (awq, gptq,
    fp8, compressed-tensors; vLLM's marlin spellings map to them). Unset is what LMI advises:
    the checkpoint's config.json says its format."""
    value = (r.raw(key.name) or "none").lower()
    value = QUANTIZE_ALIASES.get(value, value)
    if value == "none":
        return None
    if value not in QUANTIZATIONS:
        r.fail(key.name, f"one of {', '.join(QUANTIZATIONS)}, or unset to serve a quantized "
               "checkpoint as its config.json says (bitsandbytes, eetq, exl2 and squeezellm are "
               "not served)")
    return value


def async_scheduling(r: Reader, key: Key) -> bool | None:
    return ASYNC_SCHEDULING[r.choice(key.name, "auto", set(ASYNC_SCHEDULING))]


def api_server_count(r: Reader, key: Key) -> int:
    """HTTP processes sharing one engine core process (vLLM's --api-server-count)."""
    count = r.integer(key.name, key.default)
    if count > MAX_API_SERVERS:
        r.fail(key.name, f"an integer between 1 and {MAX_API_SERVERS}")
    return count


def api_server_nice(r: Reader, key: Key) -> int | None:
    """How far the HTTP threads step back for the engine core process (None: auto)."""
    value = r.raw(key.name)
    if value is None or value.lower() == "auto":
        return None
    if not value.isdigit() or int(value) > MAX_NICE:
        r.fail(key.name, f"auto or an integer between 0 and {MAX_NICE}")
    return int(value)


def max_workers(r: Reader, key: Key) -> int:
    """DJL's -1 means "as many as fit"; one call at a time is what a handler can always take."""
    workers = 1 if r.raw(key.name) == "-1" else r.integer(key.name, key.default)
    if workers > MAX_WORKERS:
        r.fail(key.name, f"an integer between 1 and {MAX_WORKERS} (or -1)")
    return workers


def entry_point(r: Reader, key: Key) -> str | None:
    """A module name, or a .py file that stays inside the model folder."""
    value = r.raw(key.name) or None
    if value is None:
        return None
    return check_entry_point(value, r.model_dir, r.settings[key.name].source)


def handler_function(r: Reader, key: Key) -> str:
    value = r.raw(key.name) or key.default
    if not value.isidentifier():
        r.fail(key.name, "the name of a Python function")
    return value


def input_formatter(r: Reader, key: Key) -> str:
    return _formatter(r, key, INPUT_FORMATTERS)


def output_formatter(r: Reader, key: Key) -> str:
    return _formatter(r, key, OUTPUT_FORMATTERS)


def _formatter(r: Reader, key: Key, builtins: tuple[str, ...]) -> str:
    """A built-in name, or the name of a function that model.py must define."""
    value = r.raw(key.name)
    if not value:
        return key.default
    return check_formatter(key.name, value, builtins, r.settings[key.name].source)


def enable_lora(r: Reader, key: Key) -> bool:
    """On when set true, or when adapters are given (TGI's LORA_ADAPTERS alone turns it on)."""
    if r.raw(key.name) is None:
        return bool(r.raw("option.lora_modules"))
    return r.flag(key.name, key.default)


def lora_rank(r: Reader, key: Key) -> int:
    """The slots' rank: one of vLLM's values (LMI passes the key to vLLM)."""
    allowed = {str(rank): str(rank) for rank in MAX_LORA_RANKS}
    return int(r.choice(key.name, str(key.default), allowed))


def lora_modules(r: Reader, key: Key) -> tuple[tuple[str, str], ...]:
    """`name=/folder,...` (TGI's LORA_ADAPTERS form); hub ids are refused: nothing is
    downloaded from a model hub."""
    value = r.raw(key.name) or ""
    modules = []
    for item in filter(None, (part.strip() for part in value.split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip().startswith("/"):
            r.fail(key.name, "name=/absolute/folder pairs separated by commas (adapters are "
                   "read from local folders, never downloaded from a hub)")
        modules.append((name.strip(), path.strip()))
    if len({name for name, _ in modules}) != len(modules):
        r.fail(key.name, "each adapter name once")
    return tuple(modules)


def _json_object(r: Reader, key: Key, fields: set[str], example: str) -> dict[str, Any] | None:
    """A key holding one of vLLM's JSON configurations: an object of known fields (None:
    unset)."""
    value = r.raw(key.name)
    if not value:
        return None
    try:
        spec = json.loads(value)
    except ValueError:
        spec = None
    if not isinstance(spec, dict):
        r.fail(key.name, f"a JSON object such as {example}")
    unknown = sorted(set(spec) - fields)
    if unknown:
        r.refuse(key.name, f"unknown field {unknown[0]!r} (known: {', '.join(sorted(fields))})")
    return spec


# Speculative decoding (engine/spec/): n-gram prompt lookup, or a draft model's folder.
_NGRAM = ("ngram", "[ngram]")
_NOT_YET = ("EAGLE, Medusa and MTP heads are not served yet; use method ngram or draft_model "
            "(a smaller model's folder with the same tokenizer)")


def speculative_draft_model(r: Reader, key: Key) -> dict[str, Any] | None:
    """LMI's key: `ngram` (vLLM's legacy `[ngram]`), or a draft model's local folder (absolute,
    or inside the model folder)."""
    value = r.raw(key.name)
    if not value:
        return None
    if value.lower() in _NGRAM:
        return {"speculative_method": "ngram"}
    return {"speculative_method": "draft_model", "speculative_model": _draft_folder(r, key.name,
                                                                                   value)}


def _draft_folder(r: Reader, name: str, value: str) -> str:
    """A draft model's local folder (absolute, or inside the model folder), with config.json."""
    path = Path(value)
    if ".." in path.parts or "://" in value:
        r.refuse(name, "a local folder (absolute, or inside the model folder) without '..'; "
                 "draft models are not downloaded")
    folder = path if path.is_absolute() else r.model_dir / path
    if not (folder / "config.json").is_file():
        r.refuse(name, f"no model folder at {folder} (config.json); a draft model is read from "
                 "a local folder, never downloaded")
    return str(folder)


_SPEC_FIELDS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                "disable_by_batch_size", "model"}


def speculative_config(r: Reader, key: Key) -> dict[str, Any] | None:
    """vLLM's JSON (`method`, `num_speculative_tokens`, `prompt_lookup_min`/`max`,
    `disable_by_batch_size`) → the engine's speculative_* fields (applied over LMI's keys)."""
    spec = _json_object(r, key, _SPEC_FIELDS, '{"method": "ngram", "num_speculative_tokens": 4}')
    if spec is None:
        return None
    model = spec.get("model")
    method = str(spec.get("method") or ("ngram" if model in _NGRAM else "draft_model"
                                        if model else ""))
    method = "draft_model" if method in ("draft", "draft_model") else method
    if method == "ngram" and model in (None, *_NGRAM):
        out: dict[str, Any] = {"speculative_method": "ngram"}
    elif method == "draft_model" and isinstance(model, str) and model not in _NGRAM:
        out = {"speculative_method": "draft_model",
               "speculative_model": _draft_folder(r, key.name, model)}
    else:
        r.refuse(key.name, _NOT_YET)
    low, high = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
    # vLLM: both unset → 5 and 5; one unset takes the other's value
    fields = {"num_speculative_tokens": spec.get("num_speculative_tokens"),
              "prompt_lookup_min": low if low is not None else high,
              "prompt_lookup_max": high if high is not None else low,
              "speculative_disable_batch_size": spec.get("disable_by_batch_size")}
    for name, number in fields.items():
        if number is None:
            continue
        if not isinstance(number, int) or isinstance(number, bool) or number < 1:
            r.fail(key.name, f"{name} as a positive integer")
        out[name] = number
    return out


# Disaggregated prefill and decode (engine/disagg/): vLLM's --kv-transfer-config JSON.
_KV_FIELDS = {"kv_connector", "kv_role", "kv_ip", "kv_port", "kv_buffer_device",
              # vLLM's, for instances a proxy pairs; one container places its workers itself
              "kv_rank", "kv_parallel_size", "kv_buffer_size", "engine_id",
              "kv_connector_extra_config"}


def kv_transfer_config(r: Reader, key: Key) -> dict[str, Any] | None:
    """vLLM's JSON → the engine's Disaggregation fields (the worker counts are keys of
    their own): the connector, kv_role kv_both, where the workers meet, where KV is staged."""
    spec = _json_object(r, key, _KV_FIELDS, '{"kv_connector": "TorchDistributedConnector", '
                        '"kv_role": "kv_both"}')
    if spec is None:
        return None
    if spec.get("kv_connector") not in KV_CONNECTORS:
        r.refuse(key.name, f"kv_connector must be one of {', '.join(KV_CONNECTORS)} (KV blocks "
                 "over torch.distributed point to point: gloo, or NCCL between GPUs)")
    if spec.get("kv_role", "kv_both") != "kv_both":
        r.refuse(key.name, "kv_role must be kv_both: this container runs its prefill and decode "
                 "workers itself (option.num_prefill_workers, option.num_decode_workers)")
    port, ip = spec.get("kv_port", 0), spec.get("kv_ip", "127.0.0.1")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port < 65536:
        r.fail(key.name, "kv_port as a TCP port (0: a free one)")
    if not isinstance(ip, str) or not ip:
        r.fail(key.name, "kv_ip as a host name or address")
    device = spec.get("kv_buffer_device", "auto")
    if device not in KV_BUFFER_DEVICES:
        r.fail(key.name, f"kv_buffer_device one of {', '.join(KV_BUFFER_DEVICES)}")
    return {"kv_connector": spec["kv_connector"], "kv_ip": ip, "kv_port": port,
            "kv_buffer_device": device, **_remote_workers(r, key, spec)}


_REMOTE_FIELDS = ("remote_prefill_workers", "remote_decode_workers", "worker_port")
WORKER_KEY_ENV = "BATCHYARD_WORKER_KEY"  # the secret remote workers prove (batchyard worker)
MAX_DISAGG_WORKERS = 64  # of each side


def _remote_workers(r: Reader, key: Key, spec: dict[str, Any]) -> dict[str, Any]:
    """kv_connector_extra_config: workers joining from other hosts, and the router's port."""
    extra = spec.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        r.fail(key.name, "kv_connector_extra_config as a JSON object")
    unknown = sorted(set(extra) - set(_REMOTE_FIELDS))
    if unknown:
        r.refuse(key.name, f"unknown kv_connector_extra_config field {unknown[0]!r} (known: "
                 f"{', '.join(_REMOTE_FIELDS)})")
    out: dict[str, Any] = {}
    for name in _REMOTE_FIELDS:
        value = extra.get(name, 0)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 65536:
            r.fail(key.name, f"{name} as an integer in 0..65535")
        out[name] = value
    if out["remote_prefill_workers"] or out["remote_decode_workers"]:
        secret = os.environ.get(WORKER_KEY_ENV, "")
        if not secret or not out["worker_port"]:
            r.refuse(key.name, f"workers on other hosts need worker_port (where they reach the "
                     f"router) and the secret they prove in {WORKER_KEY_ENV}")
        if spec.get("kv_ip", "127.0.0.1").startswith(("127.", "localhost")):
            r.refuse(key.name, "workers on other hosts need kv_ip: this host's address they "
                     "reach (the router and the workers' store listen there)")
        out["worker_key"] = secret.encode()
    return out


def disaggregation(values: Mapping[str, Any]) -> Disaggregation | None:
    """The engine's plan of workers, when option.kv_transfer_config asks for one."""
    transfer = values["option.kv_transfer_config"]
    if transfer is None:
        return None
    threshold = values["option.cooperative_prefill_threshold"]
    return Disaggregation(num_prefill_workers=values["option.num_prefill_workers"],
                          num_decode_workers=values["option.num_decode_workers"],
                          cooperative_prefill_threshold=threshold or None, **transfer)


# Rules that span keys: run once every key is read, with every resolved value by key name.

def disaggregation_fits(r: Reader, values: Mapping[str, Any]) -> None:
    """Worker keys need option.kv_transfer_config; disaggregated workers are paged, whole-model
    (no tensor parallelism), adapter-free, behind one HTTP process."""
    if values["option.kv_transfer_config"] is None:
        for name in ("option.num_prefill_workers", "option.num_decode_workers",
                     "option.cooperative_prefill_threshold"):
            if r.raw(name) is not None:
                r.refuse(name, "it takes effect with disaggregated serving: set "
                         "option.kv_transfer_config too (serving.properties.d/"
                         "disaggregated.properties)")
        return
    name = "option.kv_transfer_config"
    for workers in ("option.num_prefill_workers", "option.num_decode_workers"):
        if values[workers] > MAX_DISAGG_WORKERS:
            r.fail(workers, f"an integer in 1..{MAX_DISAGG_WORKERS}")
    if values["option.cooperative_prefill_threshold"] == 1:
        r.fail("option.cooperative_prefill_threshold", "0 (never) or an integer >= 2")
    try:
        disaggregation(values)
    except ValueError as err:  # remote worker counts against the local ones
        r.refuse(name, str(err))
    if values["option.rolling_batch"] not in PAGED_VALUES | {"auto"}:
        r.refuse(name, "disaggregated workers batch paged: set option.rolling_batch=paged")
    for ok, why, fix in (
            (values["option.tensor_parallel_degree"] == 1, "tensor parallelism (each worker "
             "runs the whole model)", "option.tensor_parallel_degree=1"),
            (not values["option.enable_lora"], "LoRA adapters", "option.enable_lora=false"),
            (values["option.api_server_count"] == 1, "several HTTP processes",
             "option.api_server_count=1")):
        if not ok:
            r.refuse(name, f"disaggregated workers do not serve {why} yet; set {fix}")

def one_batching(r: Reader, values: Mapping[str, Any]) -> None:
    """Dynamic batching (batch_size > 1) and rolling batching exclude each other."""
    rolling = values["option.rolling_batch"]
    if rolling != "disable" and values["batch_size"] > 1:
        r.refuse("batch_size", f"dynamic batching (batch_size > 1) cannot be combined with "
                 f"option.rolling_batch={rolling}; remove one of them")


def api_servers_share_a_core(r: Reader, values: Mapping[str, Any]) -> None:
    if values["option.api_server_count"] == 1:
        return
    if not values["option.engine_process"]:
        r.fail("option.api_server_count", "1 with option.engine_process=false (several HTTP "
               "processes share the engine core only when it runs in a process of its own)")
    entry = values["option.entryPoint"]
    if entry is not None and entry not in BUILTIN_ENTRY_POINTS:
        r.fail("option.api_server_count", "1 with a custom handler (option.entryPoint): each "
               "HTTP process would load its own copy of the handler's model")


def nice_needs_a_core_process(r: Reader, values: Mapping[str, Any]) -> None:
    if values["option.api_server_nice"] and not values["option.engine_process"]:
        r.fail("option.api_server_nice", "auto or 0 with option.engine_process=false (the "
               "engine core then runs on a thread of the HTTP process and would slow down too)")


def lora_limits(r: Reader, values: Mapping[str, Any]) -> None:
    """max_cpu_loras keeps at least max_loras adapters read; adapters need LoRA on."""
    cpu, slots = values["option.max_cpu_loras"], values["option.max_loras"]
    if cpu is not None and cpu < slots:
        r.fail("option.max_cpu_loras", f"an integer >= option.max_loras={slots}")
    if values["option.lora_modules"] and not values["option.enable_lora"]:
        r.refuse("option.lora_modules", "adapters are given with option.enable_lora=false; "
                 "set it to true or remove the adapters")
