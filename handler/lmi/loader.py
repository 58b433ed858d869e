"""At model load: find the model folder's handler module; either start a HandlerRunner for its
handler function (the engine is not loaded unless the handler loads it), or pick the
formatters it names for the built-in engine."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from handler.config.lmi_options import INPUT_FORMATTERS, OUTPUT_FORMATTERS, LmiOptions
from handler.config.serving_config import ServingConfig
from handler.http.formatters import Formatters
from handler.lmi.entry_point import EntryPointError, handler_function, load_module
from handler.lmi.runner import HandlerRunner
from handler.lmi.shim import ensure_djl_python

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CustomCode:
    """What the model folder's code contributes: a handler runner, or formatters."""

    runner: HandlerRunner | None
    formatters: Formatters


def load_custom_code(config: ServingConfig, allow_handler: bool = True) -> CustomCode:
    """Raises EntryPointError (also for a handler when not `allow_handler`), or what the
    handler's start-up call raises."""
    lmi, model_dir = config.lmi, Path(config.engine.model)
    djl = ensure_djl_python() if _may_import(lmi, model_dir) else None
    module = load_module(lmi, model_dir) if djl is not None else None
    if module is None and djl is not None and lmi.builtin_engine_requested:
        # LMI's own handler is asked for; model.py may still hold formatters.
        module = load_module(LmiOptions(), model_dir)
        function = None
    else:
        function = handler_function(module, lmi.handler) if module is not None else None
    if function is not None and not allow_handler:
        assert module is not None  # where the handler was found
        raise EntryPointError(f"{module.__name__}.{lmi.handler} is a custom handler: serve it "
                              "with option.api_server_count=1 (each HTTP process would run "
                              "its own copy)")
    if function is not None:
        assert module is not None and djl is not None  # found in a module, through djl_python
        runner = _runner(config, function, djl.Input)
        runner.initialize(init_properties(config))
        logger.info("serving through %s.%s; batchyard's engine is not loaded",
                    module.__name__, lmi.handler)
        _log_unused(config, custom=True)
        return CustomCode(runner, Formatters(output_name=lmi.output_formatter))
    if lmi.entry_point is not None and not lmi.builtin_engine_requested:
        raise EntryPointError(f"option.entryPoint={lmi.entry_point} defines no function "
                              f"{lmi.handler} (option.handler)")
    _log_unused(config, custom=False)
    return CustomCode(None, _formatters(lmi, module))


def _log_unused(config: ServingConfig, *, custom: bool) -> None:
    """Keys that only one of the two modes reads: say so rather than ignore them."""
    mode = ("a custom handler serves" if custom else "no custom handler serves")
    keys = (("option.input_formatter", "option.output_formatter", "option.tgi_compat") if custom
            else ("option.handler", "maxWorkers"))
    for key in keys:
        if key in config.settings:
            logger.warning("%s has no effect: %s (see docs/migrating.md)", key, mode)


def init_properties(config: ServingConfig) -> dict[str, str]:
    """DJL's start-up properties: every key with option. stripped, plus model_dir, device_id
    (-1 on CPU) and tensor_parallel_degree (1 unless configured)."""
    properties = {k.removeprefix("option."): s.value for k, s in config.settings.items()}
    properties.update(model_dir=config.engine.model, device_id=_device_id(config.engine.device))
    properties.setdefault("tensor_parallel_degree", "1")
    return properties


def _may_import(lmi: LmiOptions, model_dir: Path) -> bool:
    return (lmi.entry_point is not None and not lmi.builtin_engine_requested) or (
        model_dir / "model.py").is_file()


def _runner(config: ServingConfig, function, make_input) -> HandlerRunner:
    lmi = config.lmi
    return HandlerRunner(function, make_input, batch_size=lmi.batch_size,
                         max_batch_delay_s=lmi.max_batch_delay_ms / 1000,
                         workers=lmi.max_workers, queue_size=config.job_queue_size)


def _formatters(lmi: LmiOptions, module) -> Formatters:
    def function(key: str, name: str, builtins: tuple[str, ...]):
        if name in builtins:
            return None
        found = handler_function(module, name) if module is not None else None
        if found is None:
            raise EntryPointError(f"{key}={name}: model.py defines no such function")
        return found

    return Formatters(
        output_name=lmi.output_formatter,
        output_fn=function("option.output_formatter", lmi.output_formatter, OUTPUT_FORMATTERS),
        input_fn=function("option.input_formatter", lmi.input_formatter, INPUT_FORMATTERS))


def _device_id(device: str) -> str:
    if device == "cpu":
        return "-1"
    if device == "cuda":
        return "0"
    import torch  # auto: what the engine would pick

    return "0" if torch.cuda.is_available() else "-1"
