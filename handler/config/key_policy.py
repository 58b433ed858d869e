"""LMI keys that batchyard does not act on. None is ignored silently: each is either a no-op
that truly changes nothing here (the reason is logged and documented in docs/migrating.md), or
refused at start-up with one line naming the key and what to use instead."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from handler.config.setting import ConfigError, Setting

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NoOp:
    """A key with no effect here; `accepts` (lower case) limits it to the values that are."""

    why: str
    accepts: frozenset[str] | None = None
    instead: str = ""  # what to use when a value outside `accepts` was meant


@dataclass(frozen=True)
class Refused:
    """A feature batchyard does not have; `allows` are the values that leave it off."""

    instead: str
    allows: frozenset[str] = frozenset()


_ONE_DEVICE = "one process serves one device (option.device)"
NO_OP_KEYS: dict[str, NoOp] = {
    "engine": NoOp("batchyard always runs its own Python engine in one process; the value only "
                   "picks DJL's worker type", frozenset({"python", "mpi", "deepspeed"}),
                   "Python, MPI or DeepSpeed (all run the same engine here)"),
    "option.task": NoOp("batchyard serves text generation only", frozenset({"text-generation"}),
                        "text-generation; other tasks need their own container"),
    "option.model_loading_timeout": NoOp(
        "the model loads in the background while /ping answers 503, so the endpoint's "
        "ContainerStartupHealthCheckTimeoutInSeconds bounds loading"),
    "option.revision": NoOp("models come from a local folder or s3://, never from a model hub, "
                            "so there is no hub revision to pick"),
    "option.mpi_mode": NoOp(f"{_ONE_DEVICE}; there are no MPI ranks"),
    "option.async_mode": NoOp("requests are already served concurrently by the engine loop; LMI "
                              "uses the key to choose vLLM's async engine"),
    "option.parallel_loading": NoOp(f"{_ONE_DEVICE}: there is one copy of the weights to load"),
    "option.device_map": NoOp(f"{_ONE_DEVICE}", frozenset({"auto"}),
                              "option.device=cpu|cuda to choose the device"),
    "minWorkers": NoOp("one worker process holds the model from start-up (maxWorkers sets how "
                       "many custom-handler calls run at once)"),
    "max_idle_time": NoOp("DJL scales idle workers down; the one worker that holds the model "
                          "stays up"),
    "load_on_devices": NoOp(_ONE_DEVICE),
}

_LORA = ("batchyard serves LoRA adapters with option.enable_lora, option.max_loras, "
         "option.max_lora_rank and option.max_cpu_loras only")
REFUSED_KEYS: dict[str, Refused] = {
    "option.enable_streaming": Refused(
        "stream per request with \"stream\": true (or Accept: application/jsonlines), or every "
        "response with option.output_formatter=jsonlines", frozenset({"false"})),
    # the values that change nothing here are accepted: adapters run in the base dtype, with
    # no embedding LoRA (extra vocabulary) and no long-context scaling
    "option.lora_dtype": Refused(f"{_LORA}; adapters run in the base model's dtype",
                                 frozenset({"auto"})),
    "option.lora_extra_vocab_size": Refused(f"{_LORA}; adapters that add tokens are refused",
                                            frozenset({"0", "256"})),
    "option.fully_sharded_loras": Refused(_LORA, frozenset({"false"})),
    "option.long_lora_scaling_factors": Refused(_LORA),
    "option.adapters": Refused("put adapters in <model dir>/adapters/<name>/ or list them in "
                               "option.lora_modules (name=/folder,...)"),
    "option.pipeline_parallel_degree": Refused(f"{_ONE_DEVICE}; remove the key",
                                               frozenset({"1"})),
}
POLICY_KEYS = set(NO_OP_KEYS) | set(REFUSED_KEYS)


def apply_key_policy(settings: Mapping[str, Setting]) -> None:
    """Log each no-op key with its reason; raise ConfigError on the first refused one."""
    for key, s in sorted(settings.items()):
        value = s.value.strip().lower()
        rule = NO_OP_KEYS.get(key) or REFUSED_KEYS.get(key)
        if isinstance(rule, NoOp):
            if rule.accepts is not None and value not in rule.accepts:
                raise ConfigError(f"unsupported {key}={s.value!r} (from {s.source}): use "
                                  f"{rule.instead}")
            logger.info("%s=%s (%s) has no effect in batchyard: %s", key, s.value, s.source,
                        rule.why)
        elif isinstance(rule, Refused) and value not in rule.allows:
            raise ConfigError(f"unsupported {key}={s.value!r} (from {s.source}): "
                              f"{rule.instead}")
