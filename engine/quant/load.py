"""Pre-quantized checkpoint layers into a native model, before its float weights are read.

A module is quantized when the checkpoint says so by its tensors (a `qweight`, a
`weight_packed`, a float8 `weight`); the rest, the checkpoint's ignore list among them (lm_head,
routers), loads in full precision as before. Each quantized module is decoded into our layout
(unpack.py), cut for this tensor-parallel rank by the same placements as a float weight (rows
of a column-parallel layer; input columns of a row-parallel one, on group boundaries), and
q/k/v and gate/up parts are stacked into the model's fused layer, which is then replaced by an
IntQuantLinear or Fp8Linear."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from engine.model_files import open_checkpoint
from engine.quant.linear import Fp8Linear, IntQuantLinear
from engine.quant.scheme import QuantScheme
from engine.quant.unpack import (
    FORMAT_TENSORS,
    MARKERS,
    Decoded,
    FloatWeights,
    IntWeights,
    decode,
)

logger = logging.getLogger(__name__)

QUANTIZED_LAYERS = (IntQuantLinear, Fp8Linear)


class PlacedModel(Protocol):
    """A native model: where each checkpoint tensor lands (engine/models/placement.py)."""

    def weight_placements(self, name: str) -> list: ...

    def get_submodule(self, target: str) -> nn.Module: ...

    def modules(self) -> Iterator[nn.Module]: ...


def load_quantized(model: PlacedModel, files: list[Path], scheme: QuantScheme,
                   dtype: torch.dtype, device: torch.device) -> set[str]:
    """Replace every layer the checkpoint stores quantized; returns the checkpoint tensor names
    it read (the float loader skips them). ValueError naming a tensor that is missing,
    mis-shaped or lands where batchyard keeps no quantized layer."""
    where = _tensor_files(files)
    quantized = _quantized_modules(where, scheme)
    if not quantized:
        raise ValueError(f"config.json declares {scheme.fmt} quantization, but no tensor of the "
                         f"checkpoint is quantized (no *.{MARKERS[scheme.fmt]} in that format)")
    by_layer: dict[str, list[str]] = defaultdict(list)  # our layer → checkpoint modules
    floats: dict[str, str] = {}  # our layer → a full-precision weight landing in it
    for prefix in quantized:
        for place in model.weight_placements(prefix + ".weight"):
            by_layer[place.target.removesuffix(".weight")].append(prefix)
    for name in where:
        if name.endswith(".weight") and name.removesuffix(".weight") not in quantized:
            for place in model.weight_placements(name):
                floats[place.target.removesuffix(".weight")] = name
    read: set[str] = set()
    for layer, prefixes in by_layer.items():
        if layer in floats:
            raise ValueError(f"{floats[layer]} is stored in full precision, while "
                             f"{prefixes[0]}, fused with it into {layer}, is quantized")
        _replace_layer(model, layer, sorted(set(prefixes)), where, scheme, dtype, device, read)
    _log_paths(model, scheme)
    return read


def _log_paths(model: PlacedModel, scheme: QuantScheme) -> None:
    """Say how many layers run the fast path (Triton int GEMM, torch._scaled_mm) and how many
    dequantize every step."""
    layers = [m for m in model.modules() if isinstance(m, QUANTIZED_LAYERS)]
    fast = sum(1 for m in layers if getattr(m, "kernel", False) or getattr(m, "scaled_mm", False))
    logger.info("quantized checkpoint: %s, %d layers: %d on %s, %d dequantized per step%s",
                scheme.describe(), len(layers), fast,
                "torch._scaled_mm" if scheme.is_float else "the Triton int GEMM",
                len(layers) - fast, "" if fast == len(layers) else
                " (CPU, act-order, 2/3-bit codes, block scales or a failed start-up check)")


def _tensor_files(files: list[Path]) -> dict[str, Path]:
    where: dict[str, Path] = {}
    for file in files:
        with open_checkpoint(file) as f:
            for name in f.keys():
                where[name] = file
    return where


def _quantized_modules(where: dict[str, Path], scheme: QuantScheme) -> set[str]:
    """Prefixes (model.layers.0.self_attn.q_proj) of the modules stored quantized."""
    marker = "." + MARKERS[scheme.fmt]
    found = {name.removesuffix(marker) for name in where if name.endswith(marker)}
    if not scheme.is_float:
        return found
    # every layer has a .weight: the float8 ones are quantized (each file opened once)
    by_file: dict[Path, list[str]] = defaultdict(list)
    for prefix in found:
        by_file[where[prefix + marker]].append(prefix)
    float8: set[str] = set()
    for file, prefixes in by_file.items():
        with open_checkpoint(file) as f:
            float8.update(p for p in prefixes
                          if str(f.get_slice(p + marker).get_dtype()) == "F8_E4M3")
    return float8


def _read_module(prefix: str, where: dict[str, Path], scheme: QuantScheme,
                 read: set[str]) -> dict[str, torch.Tensor]:
    tensors = {}
    for suffix in FORMAT_TENSORS[scheme.fmt]:
        name = f"{prefix}.{suffix}"
        if name in where:
            with open_checkpoint(where[name]) as f:
                tensors[suffix] = f.get_tensor(name)
            read.add(name)
    return tensors


def _replace_layer(model: PlacedModel, layer: str, prefixes: list[str], where: dict[str, Path],
                   scheme: QuantScheme, dtype: torch.dtype, device: torch.device,
                   read: set[str]) -> None:
    """Decode each checkpoint module landing in `layer`, take this rank's part, stack the parts
    in row order and swap the float layer for the quantized one."""
    try:
        old = model.get_submodule(layer)
    except AttributeError:
        old = None
    if type(old) is not nn.Linear:
        raise ValueError(f"{prefixes[0]} is quantized, and batchyard serves quantized "
                         f"weights only in linear layers, not in {layer}")
    parts: list[tuple[int, Decoded]] = []
    for prefix in prefixes:
        decoded = decode(scheme, _read_module(prefix, where, scheme, read), prefix)
        for place in model.weight_placements(prefix + ".weight"):
            if place.target.removesuffix(".weight") == layer:
                parts.append((place.offset, _cut(decoded, place.index, prefix)))
    whole = _stack(parts, old.out_features, old.in_features, layer)
    bias = None if old.bias is None else torch.empty(old.out_features)  # read later
    if bias is None:
        _skip_zero_biases(prefixes, where, layer, read)
    new: nn.Module
    if isinstance(whole, IntWeights):
        new = IntQuantLinear(whole, scheme.bits, bias, dtype, device)
    else:
        new = Fp8Linear(whole, scheme.activations, bias, dtype, device)
    parent, _, attr = layer.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)


def _skip_zero_biases(prefixes: list[str], where: dict[str, Path], layer: str,
                      read: set[str]) -> None:
    """Older GPTQ tools store a zero bias beside every quantized layer, biased or not: where
    the architecture has none, such zeros are passed over (anything else is refused)."""
    for prefix in prefixes:
        name = f"{prefix}.bias"
        if name in where:
            with open_checkpoint(where[name]) as f:
                if f.get_tensor(name).count_nonzero():
                    raise ValueError(f"{name} is not zero, and {layer} has no bias in this "
                                     "architecture")
            read.add(name)


def _cut(decoded: Decoded, index: tuple[slice, ...] | None, name: str) -> Decoded:
    """This rank's part: (rows,) or (everything, columns)."""
    if index is None:
        raise ValueError(f"{name}: no part of this quantized weight lands on this rank")
    if len(index) > 1:
        decoded = decoded.columns(index[1], name)
    return decoded.rows(index[0])


def _stack(parts: list[tuple[int, Decoded]], rows: int, columns: int, layer: str) -> Decoded:
    """The parts stacked by their first row into [rows, columns]; rows past the last part (a
    vocabulary slice's padding) get zero scales."""
    parts.sort(key=lambda p: p[0])
    first = parts[0][1]
    at = 0
    for offset, part in parts:
        got = part.codes.shape if isinstance(part, IntWeights) else part.weight.shape
        if offset != at or got[1] != columns or type(part) is not type(first):
            raise ValueError(f"the quantized parts of {layer} do not fit its "
                             f"[{rows}, {columns}] weight (a part of shape {tuple(got)} at row "
                             f"{offset})")
        at += got[0]
    if at > rows:
        raise ValueError(f"the quantized parts of {layer} hold {at} rows; it has {rows}")
    if isinstance(first, IntWeights):
        return _stack_int([p for _, p in parts], rows - at, layer)  # type: ignore[misc]
    return _stack_float([p for _, p in parts], rows - at, layer)  # type: ignore[misc]


def _stack_int(parts: list[IntWeights], pad: int, layer: str) -> IntWeights:
    first = parts[0]
    if any(part.group != first.group for part in parts):
        raise ValueError(f"the fused parts of {layer} (q/k/v or gate/up) are quantized with "
                         "different group sizes")
    g_idx, bounds = _part_g_idx(parts)
    codes = torch.cat([p.codes for p in parts])
    scales = torch.cat([p.scales for p in parts])
    zeros = torch.cat([p.zeros for p in parts])
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad, codes.shape[1])])
        scales = torch.cat([scales, scales.new_zeros(pad, scales.shape[1])])
        zeros = torch.cat([zeros, zeros.new_zeros(pad, zeros.shape[1])])
    return replace(first, codes=codes, scales=scales, zeros=zeros, g_idx=g_idx, bounds=bounds)


def _part_g_idx(parts: list[IntWeights]) -> tuple[torch.Tensor | None, tuple[int, ...] | None]:
    """One g_idx for the fused layer where its parts agree (None: none reorders), else one
    per part [parts, K] and the parts' row bounds (act-order quantizes each on its own)."""
    kept = [p.g_idx for p in parts]
    if all(g is None for g in kept):
        return None, None
    k = parts[0].codes.shape[1]
    full = [torch.arange(k) // p.group if g is None else g
            for p, g in zip(parts, kept, strict=True)]
    if all(torch.equal(g, full[0]) for g in full):
        return full[0], None
    starts = [0]
    for p in parts:
        starts.append(starts[-1] + p.codes.shape[0])
    return torch.stack(full), tuple(starts)


def _stack_float(parts: list[FloatWeights], pad: int, layer: str) -> FloatWeights:
    first = parts[0]
    if any(p.block != first.block for p in parts):
        raise ValueError(f"the fused parts of {layer} have different fp8 scale blocks")
    weight = torch.cat([p.weight for p in parts])
    scales = torch.cat([p.scales for p in parts])
    if pad:
        weight = torch.cat([weight, weight.new_zeros(pad, weight.shape[1])])
        scales = torch.cat([scales, scales.new_zeros(pad, scales.shape[1])])
    inputs = [p.input_scale for p in parts if p.input_scale is not None]
    if not inputs:
        return replace(first, weight=weight, scales=scales)
    if len(inputs) != len(parts):
        raise ValueError(f"the fused parts of {layer} lack some of their input_scale tensors")
    if all(torch.equal(s, inputs[0]) for s in inputs):
        return replace(first, weight=weight, scales=scales, input_scale=inputs[0])
    # NOTE: each part keeps its own static activation scale (transformers' arithmetic), where
    # vLLM takes the largest for the fused matmul
    starts = [0]
    for p in parts:
        starts.append(starts[-1] + p.weight.shape[0])
    return replace(first, weight=weight, scales=scales, input_scale=torch.stack(inputs),
                   bounds=tuple(starts))



def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate (empty) every parameter and buffer still on the meta device, on `device`; the
    quantized layers already hold their weights and are left as they are."""
    for module in model.modules():
        if not isinstance(module, QUANTIZED_LAYERS):
            module.to_empty(device=device, recurse=False)
