"""Find the handler as LMI does: option.entryPoint (a module, or a file inside the model
folder) → DJL_ENTRY_POINT (read into option.entryPoint at start-up) → model.py in the model
folder; the function is option.handler (default `handle`)."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from handler.config.lmi_options import LmiOptions

logger = logging.getLogger(__name__)

DEFAULT_FILE = "model.py"


class EntryPointError(ValueError):
    """The entry point cannot be loaded; the message names option.entryPoint or the file."""


def load_module(lmi: LmiOptions, model_dir: Path) -> ModuleType | None:
    """The user's module, or None when the built-in engine serves (no entry point, or one of
    LMI's own text-generation handlers)."""
    if lmi.builtin_engine_requested:
        logger.info("option.entryPoint=%s: served by batchyard's engine", lmi.entry_point)
        return None
    entry = lmi.entry_point
    if entry is None:
        return _import_file(model_dir / DEFAULT_FILE, model_dir) if (
            model_dir / DEFAULT_FILE).is_file() else None
    if entry.endswith(".py") or "/" in entry:
        path = (model_dir / entry).resolve()
        if not path.is_relative_to(model_dir.resolve()) or not path.is_file():
            raise EntryPointError(f"option.entryPoint={entry}: no such file in {model_dir}")
        return _import_file(path, model_dir)
    local = model_dir / (entry.replace(".", "/") + ".py")
    if local.is_file():
        return _import_file(local, model_dir)
    _add_model_dir(model_dir)
    try:
        return importlib.import_module(entry)
    except ImportError as err:
        raise EntryPointError(f"option.entryPoint={entry}: cannot import it ({err})") from err


def handler_function(module: ModuleType, name: str) -> Callable | None:
    function = getattr(module, name, None)
    return function if callable(function) else None


def _import_file(path: Path, model_dir: Path) -> ModuleType:
    """Import a handler file; its folder goes on sys.path so that it can import its
    neighbours, as DJL does."""
    _add_model_dir(model_dir)
    name = f"batchyard_user_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise EntryPointError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    logger.info("loaded handler module %s", path)
    return module


def _add_model_dir(model_dir: Path) -> None:
    if str(model_dir) not in sys.path:
        sys.path.insert(0, str(model_dir))
