"""Read an HF model folder (config.json + safetensors) into a native model. Never runs its code."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.models.llama import LlamaForCausalLM
from engine.models.registry import NATIVE_ARCHITECTURES, PICKLE_SUFFIXES

logger = logging.getLogger(__name__)

_FAMILIES = {"llama": LlamaForCausalLM}  # NATIVE_ARCHITECTURES value -> implementation


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
    config = read_config(model_dir)
    arch = (config.get("architectures") or ["?"])[0]
    if arch not in NATIVE_ARCHITECTURES:
        raise ValueError(f"architecture {arch} is not supported natively; supported: "
                         f"{', '.join(sorted(NATIVE_ARCHITECTURES))}")
    model_cls = _FAMILIES[NATIVE_ARCHITECTURES[arch]]
    spec = model_cls.spec_from_config(arch, config)
    model = model_cls(config, spec)
    model.load_hf_weights(load_state_dict(model_dir))
    model.to(device=device, dtype=dtype).eval()
    logger.info("loaded %s (%.1f M parameters) from %s as %s on %s", arch,
                sum(p.numel() for p in model.parameters()) / 1e6, model_dir, dtype, device)
    return model, spec


def eos_token_ids(model_dir: Path, tokenizer) -> frozenset[int]:
    """EOS ids from generation_config.json (int or list) plus the tokenizer's own."""
    ids: set[int] = set()
    path = model_dir / "generation_config.json"
    if path.exists():
        eos = json.loads(path.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
