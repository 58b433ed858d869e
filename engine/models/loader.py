"""Read an HF model folder (config.json + safetensors) into a native model. Never runs its code."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

logger = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class ModelSpec:
    """Facts about the loaded model that the engine sizes itself by."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    sliding_window: int | None

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V of one token over all layers."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


def resolve_device(name: str) -> torch.device:
    """`auto`: CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("invalid device='cuda': no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on GPU, float32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def read_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} has no config.json: not a transformers model folder")
    return json.loads(path.read_text())


def load_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's *.safetensors files; pickled checkpoints are refused."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in Path(model_dir).iterdir() if p.suffix in PICKLE_SUFFIXES]
        detail = f" (found pickle checkpoints {pickles[:3]})" if pickles else ""
        raise ValueError(f"{model_dir} has no *.safetensors weights{detail}: only safetensors "
                         "are loaded, because unpickling a checkpoint can run arbitrary code")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file, device="cpu"))
    return state


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device):
    """Build the native model for the folder's architecture; returns (model, ModelSpec)."""
    from engine.models import MODELS

    config = read_config(model_dir)
    arch = (config.get("architectures") or ["?"])[0]
    if arch not in MODELS:
        raise ValueError(f"architecture {arch} is not supported natively; supported: "
                         f"{', '.join(sorted(MODELS))}")
    model_cls = MODELS[arch]
    spec = model_cls.spec_from_config(arch, config)
    model = model_cls(config, spec)
    model.load_hf_weights(load_state_dict(model_dir))
    model.to(device=device, dtype=dtype).eval()
    logger.info("loaded %s (%.1f M parameters) from %s as %s on %s", arch,
                sum(p.numel() for p in model.parameters()) / 1e6, model_dir, dtype, device)
    return model, spec
