"""PEFT LoRA adapter folders (adapter_config.json + adapter_model.safetensors): read, and refuse
what batchyard cannot apply exactly (DoRA, biases, saved modules, embedding LoRA, weights that
rewrite the base), with the reason. Pure reading: where each matrix lands in the model is
engine/lora/weights.py's business.

PEFT's math, applied unmerged: y = x Wᵀ + s · (x Aᵀ) Bᵀ with s = α / r (rsLoRA: α / √r), A [r, in]
and B [out, r] per target module; rank_pattern and alpha_pattern give a module its own r and α
(the first pattern matching a suffix of its name at a "." boundary, as PEFT matches them).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.lora.errors import AdapterError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# What a module's name ends with, per kind of base layer batchyard applies LoRA to; fused
# names are how checkpoints that store q/k/v or gate/up fused (Phi-3) name them.
TARGET_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                   "qkv_proj", "gate_up_proj")
# PEFT initialisations that rewrite the base weights, so the adapter alone is not the model
REWRITING_INITS = ("pissa", "olora", "corda", "loftq")
_TENSOR = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])(\.default)?\.weight$")


@dataclass(frozen=True)
class LoraModule:
    """One target module's low-rank update: y += scale · (x Aᵀ) Bᵀ."""

    a: torch.Tensor  # [r, in] float32
    b: torch.Tensor  # [out, r] float32
    scale: float


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter as read from its folder, in float32 on the host."""

    name: str
    path: str
    modules: dict[str, LoraModule]  # the base model's module name -> its update

    @property
    def rank(self) -> int:
        return max(m.a.shape[0] for m in self.modules.values())

    @property
    def num_bytes(self) -> int:
        return sum(4 * (m.a.numel() + m.b.numel()) for m in self.modules.values())


def read_adapter(name: str, path: str | Path, max_rank: int) -> LoraAdapter:
    """The adapter in folder `path`, or AdapterError naming what is wrong with it."""
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterError(f"adapter {name!r}: {folder} is not a folder")
    config = _read_config(name, folder)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        older = " (adapter_model.bin is not read: safetensors only)" if (
            folder / "adapter_model.bin").exists() else ""
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} is missing{older}")
    try:
        tensors = load_file(str(weights))
    except Exception as err:  # a truncated or foreign file
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} cannot be read: {err}") from err
    pairs = _pairs(name, tensors)
    if not pairs:
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA matrices")
    modules = {module: _module(name, module, a, b, config, max_rank)
               for module, (a, b) in pairs.items()}
    return LoraAdapter(name, str(folder), modules)


def _read_config(name: str, folder: Path) -> dict:
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError as err:
        raise AdapterError(f"adapter {name!r}: {CONFIG_FILE} is missing") from err
    except (OSError, ValueError) as err:
        raise AdapterError(f"adapter {name!r}: {CONFIG_FILE} is not JSON: {err}") from err
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    refusals = [
        (peft_type != "LORA", f"peft_type {peft_type} (only LORA is served)"),
        (bool(config.get("use_dora")), "use_dora: DoRA is not supported"),
        (config.get("bias", "none") != "none", f"bias={config.get('bias')!r} (only 'none')"),
        (bool(config.get("lora_bias")), "lora_bias is not supported"),
        (bool(config.get("modules_to_save")),
         f"modules_to_save {config.get('modules_to_save')} (full module copies are not served)"),
        (bool(config.get("fan_in_fan_out")), "fan_in_fan_out (Conv1D bases) is not supported"),
        (str(config.get("init_lora_weights", True)).lower().startswith(REWRITING_INITS),
         f"init_lora_weights={config.get('init_lora_weights')!r} rewrites the base weights"),
        (not isinstance(config.get("r"), int) or config["r"] < 1, f"r={config.get('r')!r} "
         "(a positive integer)"),
    ]
    for refused, why in refusals:
        if refused:
            raise AdapterError(f"adapter {name!r}: {why}")
    return config


def _pairs(name: str, tensors: dict[str, torch.Tensor]
           ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module name -> (A, B), every tensor accounted for."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR.match(key)
        if match is None:
            raise AdapterError(f"adapter {name!r}: tensor {key} is not a LoRA A or B matrix "
                               "of a linear layer (embedding LoRA, DoRA magnitudes and saved "
                               "modules are not served)")
        module = match["module"]
        if module.rsplit(".", 1)[-1] not in TARGET_SUFFIXES:
            raise AdapterError(f"adapter {name!r}: unknown target module {module} (LoRA applies "
                               f"to {', '.join(TARGET_SUFFIXES)})")
        found.setdefault(module, {})[match["ab"]] = tensor
    for module, ab in found.items():
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise AdapterError(f"adapter {name!r}: {module}.{missing}.weight is missing")
    return {module: (ab["A"], ab["B"]) for module, ab in found.items()}


def _module(name: str, module: str, a: torch.Tensor, b: torch.Tensor, config: dict,
            max_rank: int) -> LoraModule:
    try:
        rank = _pattern_value(config.get("rank_pattern") or {}, module, config["r"])
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module,
                               config.get("lora_alpha", 8))
    except (re.error, AttributeError, TypeError) as err:
        raise AdapterError(f"adapter {name!r}: rank_pattern or alpha_pattern is not a map of "
                           f"module patterns: {err}") from err
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"adapter {name!r}: rank {rank!r} of {module} (a positive integer)")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(f"adapter {name!r}: lora_alpha {alpha!r} of {module} (a number)")
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
        raise AdapterError(f"adapter {name!r}: {module} has lora_A {tuple(a.shape)} and lora_B "
                           f"{tuple(b.shape)}, not [r, in] and [out, r] with r={rank}")
    if rank > max_rank:
        raise AdapterError(f"adapter {name!r}: rank {rank} of {module} is above "
                           f"max_lora_rank={max_rank}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return LoraModule(a.float().contiguous(), b.float().contiguous(), float(scale))


def _pattern_value(patterns: dict, module: str, default: float) -> float:
    """PEFT's rule: the first pattern matching a suffix of the module name at a '.'."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default
