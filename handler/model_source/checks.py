"""What a servable model folder holds: config.json and safetensors weights, never pickles."""

from __future__ import annotations

from pathlib import Path

from engine import PICKLE_SUFFIXES


def is_model_dir(path: Path) -> bool:
    """Weights the engine loads, or an LMI handler (model.py) that decides what it needs."""
    return ((path / "config.json").is_file() and any(path.glob("*.safetensors"))) or (
        path / "model.py").is_file()


def check_model_dir(path: Path, has_handler: bool = False) -> Path:
    """Raise ValueError unless `path` holds config.json and safetensors weights, or a handler
    (model.py, or the option.entryPoint file) that loads what it needs itself."""
    if not path.is_dir():
        raise ValueError(f"model folder {path} does not exist")
    if has_handler or (path / "model.py").is_file():
        return path
    if not (path / "config.json").is_file():
        raise ValueError(f"model folder {path} has no config.json")
    if not any(path.glob("*.safetensors")):
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        why = f" (it has pickle checkpoints: {', '.join(pickles[:3])})" if pickles else ""
        raise ValueError(f"model folder {path} has no *.safetensors weights{why}; only "
                         "safetensors are loaded because unpickling can run arbitrary code")
    return path
