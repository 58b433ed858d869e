"""LmiOptions: the LMI migration keys (custom handler, formatters, TGI shape), read once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from handler.config.setting import ConfigError

# LMI's own handlers for text generation: they mean "the built-in engine" here.
BUILTIN_ENTRY_POINTS = frozenset({
    "djl_python.huggingface", "djl_python.transformers_neuronx", "djl_python.deepspeed",
    "djl_python.tensorrt_llm", "djl_python.lmi_vllm.vllm_async_service",
    "djl_python.lmi_trtllm.trtllm_async_service", "djl_python.rolling_batch.vllm_rolling_batch",
})
OUTPUT_FORMATTERS = ("json", "jsonlines", "sse", "tgi")
INPUT_FORMATTERS = ("json", "tgi")  # both read the LMI/TGI request schema
MAX_WORKERS = 64


@dataclass(frozen=True)
class LmiOptions:
    """How requests reach the model: a custom djl_python handler, or the built-in engine with
    optional formatters around it."""

    entry_point: str | None = None  # a module name or a file under the model folder
    handler: str = "handle"  # the function the entry point exposes
    input_formatter: str = "json"  # a built-in name or a function of the model folder's model.py
    output_formatter: str = "json"
    tgi_compat: bool = False  # TGI-shaped responses (same as output_formatter=tgi)
    max_workers: int = 1  # custom-handler calls that may run at once
    # Inputs the custom handler gets in one call (batch_size), and how long the first waits for
    # the rest (max_batch_delay): the handler's own batching, which the engine never sees.
    batch_size: int = 1
    max_batch_delay_ms: float = 100.0

    @property
    def builtin_engine_requested(self) -> bool:
        return self.entry_point in BUILTIN_ENTRY_POINTS


def check_entry_point(value: str, model_dir: Path, source: str) -> str:
    """A module name, or a path that stays inside the model folder; raises ConfigError."""
    if not value.endswith(".py") and "/" not in value and "\\" not in value:
        if not all(part.isidentifier() for part in value.split(".")):
            raise ConfigError(f"invalid option.entryPoint={value!r} (from {source}): expected a "
                              "module name or a .py file inside the model folder")
        return value
    path = Path(value)
    root = model_dir.resolve()
    resolved = (path if path.is_absolute() else root / path).resolve()
    if "\\" in value or not resolved.is_relative_to(root):
        raise ConfigError(f"invalid option.entryPoint={value!r} (from {source}): the file must "
                          f"be inside the model folder {model_dir}")
    return str(resolved.relative_to(root))


def check_formatter(key: str, value: str, builtins: tuple[str, ...], source: str) -> str:
    """A built-in name, or the name of a function that model.py must define."""
    if value.lower() in builtins:
        return value.lower()
    if not value.isidentifier():
        raise ConfigError(f"invalid {key}={value!r} (from {source}): expected one of "
                          f"{', '.join(builtins)} or the name of a function in model.py")
    return value
