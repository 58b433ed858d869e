"""Where LoRA adapters come from: the model folder's adapters/<name>/ (LMI's layout, registered
at start-up), and the folders that registration routes may name. A client-given path is a path
on this host, so it is confined: it must resolve (symlinks followed, no "..") inside an allowed
root and hold a PEFT safetensors checkpoint; anything else is refused before the engine reads
a byte of it."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

ADAPTERS_DIR = "adapters"  # <model dir>/adapters/<name>/ (LMI)
# SageMaker unpacks an adapter inference component's artifact somewhere under /opt/ml; nothing
# else on the host is the platform's to hand us.
SAGEMAKER_ROOT = Path("/opt/ml")
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
# An adapter name: a path segment, a Prometheus label value and an OpenAI model id at once.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}$")


class AdapterPathError(ValueError):
    """A name or folder refused before the engine sees it; the message says why."""


class BadCheckpoint(AdapterPathError):
    """A folder inside the roots that holds no PEFT safetensors checkpoint."""


def check_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise AdapterPathError(
            f"adapter name {str(name)[:60]!r} is not valid: 1-128 letters, digits and ._:@+- "
            "(starting with a letter or digit)")
    return name


def allowed_roots(model_dir: Path) -> list[Path]:
    """The model folder's adapters/ and SageMaker's /opt/ml (vLLM has no such limit: this is
    the narrowest that still takes both LMI's layout and SageMaker's adapter components)."""
    return [model_dir / ADAPTERS_DIR, SAGEMAKER_ROOT]


def confined_folder(src: object, roots: Iterable[Path]) -> str:
    """The real path of a client-given adapter folder inside one of `roots`, holding a PEFT
    safetensors checkpoint; raises AdapterPathError naming what is wrong (never the roots'
    own contents)."""
    if not isinstance(src, str) or not src:
        raise AdapterPathError("src must be a non-empty path")
    src = src.removeprefix("file://")
    if "://" in src:
        raise AdapterPathError("src must be a local folder (file:// or a path); download "
                               "adapters before registering them")
    if ".." in Path(src).parts or "\x00" in src:
        raise AdapterPathError("src must not contain '..'")
    real = Path(os.path.realpath(src))
    if not any(real.is_relative_to(os.path.realpath(root)) for root in roots):
        raise AdapterPathError("src is outside the folders adapters may be read from (the "
                               f"model folder's {ADAPTERS_DIR}/ or {SAGEMAKER_ROOT})")
    check_checkpoint(real)
    for name in (CONFIG, WEIGHTS):  # a file inside may be a link out of the folder
        if not Path(os.path.realpath(real / name)).is_relative_to(real):
            raise AdapterPathError(f"src's {name} links outside its folder")
    return str(real)


def check_checkpoint(folder: Path) -> None:
    if not folder.is_dir():
        raise BadCheckpoint("src is not a folder")
    if not (folder / CONFIG).is_file():
        raise BadCheckpoint(f"the adapter folder holds no {CONFIG}")
    if not (folder / WEIGHTS).is_file():
        bin_only = (folder / "adapter_model.bin").is_file()
        raise BadCheckpoint(
            f"the adapter folder holds no {WEIGHTS}"
            + (" (adapter_model.bin is not read: pickle files can run code; save it with "
               "safe_serialization=True)" if bin_only else ""))


def startup_adapters(model_dir: Path) -> list[tuple[str, str]]:
    """(name, folder) of every subfolder of <model dir>/adapters, sorted by name; a folder
    whose name or files are wrong stops the start, naming it."""
    root = model_dir / ADAPTERS_DIR
    if not root.is_dir():
        return []
    found = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        try:
            found.append((check_name(folder.name),
                          confined_folder(str(folder), [root])))
        except AdapterPathError as err:
            raise AdapterPathError(f"{folder}: {err}") from err
    return found
