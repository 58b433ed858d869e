"""compressed-tensors checkpoints (the format llm-compressor writes) made from a tiny model, and
transformers' own greedy output for them.

`write_ct_checkpoint` quantizes every Linear but `lm_head` with compressed-tensors alone (no
calibration data: the weight scales come from each weight's own min/max, as llm-compressor's
default observer for weights computes them) and saves it as llm-compressor's
`model.save_pretrained` does: `ModelCompressor.compress_model`, `save_pretrained`, then
`ModelCompressor.update_config` writes `quantization_config` into config.json.

Schemes:
  W4A16        int4 symmetric weights, one scale per group of 32 input columns (the preset's
               group of 128 exceeds the tiny model's K=64), stored `pack-quantized`
               (`weight_packed` int32 [N, K/8], `weight_scale` [N, K/32], `weight_shape` [2]).
  FP8_DYNAMIC  the preset: fp8 e4m3 weights with one scale per output channel, stored
               `float-quantized` (`weight` float8_e4m3fn [N, K], `weight_scale` [N, 1]), and
               dynamic per-token fp8 activations (no activation tensors in the checkpoint).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tests.engine_harness import hf_greedy

SCHEMES = ("W4A16", "FP8_DYNAMIC")
W4A16_GROUP_SIZE = 32
FORMATS = {"W4A16": "pack-quantized", "FP8_DYNAMIC": "float-quantized"}
_MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors.index.json"}


def _scheme(scheme: str):
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationScheme,
        preset_name_to_scheme,
    )

    if scheme == "W4A16":
        weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                                   group_size=W4A16_GROUP_SIZE, dynamic=False)
        return QuantizationScheme(targets=["Linear"], weights=weights)
    if scheme == "FP8_DYNAMIC":
        return preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
    raise ValueError(f"unknown scheme {scheme!r}; expected one of {SCHEMES}")


def _calibrate_weight(module: torch.nn.Module) -> None:
    """Set the module's weight scale (and zero point) from the weight's own min/max, per group
    (group strategy) or per output row (channel strategy)."""
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.utils import calculate_qparams

    args = module.quantization_scheme.weights
    weight = module.weight.detach()
    if args.strategy == "group":
        grouped = weight.unflatten(-1, (weight.shape[-1] // args.group_size, args.group_size))
        lo, hi = grouped.amin(dim=-1), grouped.amax(dim=-1)  # [N, K / group]
    elif args.strategy == "channel":
        lo, hi = weight.amin(dim=-1, keepdim=True), weight.amax(dim=-1, keepdim=True)  # [N, 1]
    else:
        raise ValueError(f"weight strategy {args.strategy!r} not handled")
    scale, zero_point = calculate_qparams(lo, hi, args)
    with torch.no_grad():
        module.weight_scale.data = scale.to(module.weight_scale.dtype)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data = zero_point.to(module.weight_zero_point.dtype)
    module.quantization_status = QuantizationStatus.FROZEN


def write_ct_checkpoint(src: Path, dst: Path, scheme: str) -> Path:
    """Quantize the float model in `src` with `scheme` ("W4A16" or "FP8_DYNAMIC"), lm_head left
    dense, and save the compressed-tensors checkpoint plus src's tokenizer files in `dst`."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    src, dst = Path(src), Path(dst)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    config = QuantizationConfig(config_groups={"group_0": _scheme(scheme)}, ignore=["lm_head"])
    apply_quantization_config(model, config, show_progress=False)
    quantized = [m for m in model.modules() if getattr(m, "quantization_scheme", None)]
    assert quantized, "no module matched the quantization targets"
    for module in quantized:
        _calibrate_weight(module)

    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=FORMATS[scheme])
    compressor.compress_model(model)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():  # tokenizer files; weights and configs come from save_pretrained
        if f.is_file() and f.suffix != ".safetensors" and f.name not in _MODEL_FILES:
            shutil.copy2(f, dst / f.name)
    model.save_pretrained(dst)
    compressor.update_config(str(dst))
    return dst


def ct_reference_greedy(folder: Path, prompt: list[int], max_new: int) -> list[int]:
    """transformers' greedy continuation of `prompt` for the compressed-tensors checkpoint in
    `folder`, in float32 on the CPU (its default route: the weights are decompressed to dense
    on the first forward pass; FP8_DYNAMIC activations are quantize-dequantized per token)."""
    model = AutoModelForCausalLM.from_pretrained(Path(folder), dtype=torch.float32)
    model.eval()
    return hf_greedy(model, prompt, max_new)
