"""Make `import djl_python` work for a user's handler without ever shadowing the real package.

The stand-in lives in handler/lmi/djl_compat/djl_python. Its parent folder is appended to
sys.path (after site-packages), and only when no djl_python is importable: a real DJL install
always wins. Shipping a top-level djl_python package in our wheel instead would collide with
the real one in site-packages (one overwrites the other's files)."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

COMPAT_DIR = Path(__file__).resolve().parent / "djl_compat"


def ensure_djl_python() -> ModuleType:
    """The djl_python module a handler will import: the real one if installed, else ours."""
    if importlib.util.find_spec("djl_python") is None and str(COMPAT_DIR) not in sys.path:
        sys.path.append(str(COMPAT_DIR))
    module = importlib.import_module("djl_python")
    where = "batchyard's stand-in" if is_stand_in(module) else "the installed package"
    logger.info("djl_python for custom handlers: %s (%s)", where, module.__file__)
    return module


def is_stand_in(module: ModuleType) -> bool:
    return Path(module.__file__ or "").resolve().is_relative_to(COMPAT_DIR)
