"""Read an HF model folder (config.json + safetensors) into a native model. Never runs its code."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.model_files import open_checkpoint, read_json_object
from engine.models.gemma import GemmaForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.registry import NATIVE_ARCHITECTURES, PICKLE_SUFFIXES, Family, native_names
from engine.models.spec import ModelSpec
from engine.parallel.shard import Shard
from engine.quant.load import load_quantized, materialize
from engine.quant.scheme import scheme_from_config

if TYPE_CHECKING:
    from engine.parallel.comm import Collectives

logger = logging.getLogger(__name__)

# a record's family -> the implementation that reads its features
_FAMILIES: dict[Family, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM, "gemma": GemmaForCausalLM}


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


# AutoAWQ's and AutoGPTQ's own files, read where config.json has no quantization_config
LEGACY_QUANT_FILES = (("quant_config.json", "awq"), ("quantize_config.json", "gptq"))


def read_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} has no config.json: not a transformers model folder")
    config = read_json_object(path)
    for name, method in LEGACY_QUANT_FILES:
        legacy = Path(model_dir) / name
        if "quantization_config" not in config and legacy.is_file():
            config["quantization_config"] = {"quant_method": method,
                                             **read_json_object(legacy)}
    return config


def spec_from_files(model_dir: str | Path, model_impl: str = "auto",
                    shard: Shard | None = None) -> ModelSpec | None:
    """The ModelSpec that load_model will give `shard`'s rank, from config.json alone, before
    any weights load; None where only loading tells (the transformers fallback), or where the
    load will refuse the folder with its own error."""
    shard = shard or Shard()
    try:
        config = read_config(model_dir)
        arch = (config.get("architectures") or ["?"])[0]
        if arch not in NATIVE_ARCHITECTURES or model_impl == "transformers":
            return None
        model_cls = _FAMILIES[NATIVE_ARCHITECTURES[arch].family]
        if model_cls.unsupported(arch, config) is not None:
            return None
        spec = model_cls.spec_from_config(arch, config)
        shard.check(spec.num_heads, spec.num_kv_heads)  # the model refuses it, naming it
    except Exception:  # noqa: BLE001 - the load says what is wrong with the folder
        return None
    return spec.of_rank(shard)


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The folder's *.safetensors files; pickled checkpoints are refused."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in Path(model_dir).iterdir() if p.suffix in PICKLE_SUFFIXES]
        detail = f" (found pickle checkpoints {pickles[:3]})" if pickles else ""
        raise ValueError(f"{model_dir} has no *.safetensors weights{detail}: only safetensors "
                         "are loaded, because unpickling a checkpoint can run arbitrary code")
    return files


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device,
               shard: Shard | None = None, comm: Collectives | None = None,
               trust_remote_code: bool = False, model_impl: str = "auto",
               quantize: str | None = None):
    """Build the native model for the folder's architecture (this rank's shard of it); returns
    (model, ModelSpec of what this rank holds).

    The modules are built on the meta device and materialised empty in `dtype` on `device`;
    each checkpoint tensor is then read, one at a time, as the slice this rank keeps. The host
    never holds a full-precision copy of the model, nor more than one tensor beyond it.
    A pre-quantized checkpoint (config.json's quantization_config) keeps its quantized layers
    quantized (engine/quant/); `quantize` is option.quantize, checked against it."""
    config = read_config(model_dir)
    arch = (config.get("architectures") or ["?"])[0]
    scheme = scheme_from_config(config, quantize)
    if scheme is not None and (arch not in NATIVE_ARCHITECTURES or model_impl == "transformers"
                               or model_cls_lacks(arch, config)):
        raise ValueError(f"{arch} with a quantized checkpoint ({scheme.fmt}): quantized "
                         f"checkpoints load natively only; native: {native_names()}")
    if arch not in NATIVE_ARCHITECTURES and model_impl == "native":
        raise ValueError(f"architecture {arch} is not supported natively (model_impl=native); "
                         f"native: {native_names()}")
    if arch not in NATIVE_ARCHITECTURES or model_impl == "transformers":
        return _load_fallback(model_dir, config, arch, dtype, device, shard, trust_remote_code)
    model_cls = _FAMILIES[NATIVE_ARCHITECTURES[arch].family]
    lacking = model_cls.unsupported(arch, config)
    if lacking is not None:
        if model_impl == "native":
            raise ValueError(f"{arch} is native, but not with {lacking} (model_impl=native); "
                             "model_impl=auto serves it through the transformers fallback")
        logger.info("%s: the native modules do not run %s; using the transformers fallback",
                    arch, lacking)
        return _load_fallback(model_dir, config, arch, dtype, device, shard, trust_remote_code)
    files = checkpoint_files(model_dir)
    with torch.device("meta"):
        model = model_cls(config, model_cls.spec_from_config(arch, config), shard, comm)
    model = model.to(dtype=dtype)
    # quantized layers replace their float ones while those are still unallocated (meta)
    quantized = set() if scheme is None else load_quantized(model, files, scheme, dtype, device)
    materialize(model, device)
    model.init_rope()
    read_weights(model, files, skip=quantized)
    model.quantization = None if scheme is None else scheme.describe()
    model.eval()
    logger.info("loaded %s natively (%.1f M parameters on this rank) from %s as %s on %s", arch,
                sum(p.numel() for p in model.parameters()) / 1e6, model_dir, dtype, device)
    return model, model.spec


def model_cls_lacks(arch: str, config: dict) -> bool:
    """Whether the native modules of a native architecture cannot run this config."""
    return _FAMILIES[NATIVE_ARCHITECTURES[arch].family].unsupported(arch, config) is not None


def _load_fallback(model_dir: str | Path, config: dict, arch: str, dtype: torch.dtype,
                   device: torch.device, shard: Shard | None, trust_remote_code: bool):
    """Not native: transformers' own modules on our KV pool (engine/models/hf_fallback.py)."""
    from engine.models.hf_fallback import load_fallback

    if shard is not None and not shard.is_whole:
        raise ValueError(f"architecture {arch} runs through the transformers fallback, which has "
                         f"no tensor parallelism; natively sharded: {native_names()}")
    checkpoint_files(model_dir)  # safetensors only, with the same message
    model = load_fallback(model_dir, config, dtype, device, trust_remote_code)
    return model, model.spec


@torch.no_grad()
def read_weights(model, files: list[Path], skip: set[str] | frozenset[str] = frozenset()
                 ) -> None:
    """Copy each checkpoint tensor's slice for this rank into place (cast on the way); raises
    ValueError on a tensor the model has no place for, a wrong shape, or a missing weight."""
    params = dict(model.named_parameters())
    for param in params.values():
        param.zero_()  # a vocabulary slice's padding rows and other ranks' biases stay zero
    written: Counter[str] = Counter()
    for file in files:
        with open_checkpoint(file) as f:
            names = list(f.keys())
        for name in names:
            if name in skip:  # read by the quantized loader
                continue
            for place in model.weight_placements(name):
                param = params.get(place.target)
                if param is None:
                    raise ValueError(f"unexpected weight {name} in checkpoint {file.name}")
                written[place.target] += _copy_part(file, name, place, param)
    missing = [name for name, rows in model.expected_rows().items() if written[name] != rows]
    if missing:
        raise ValueError(f"the checkpoint lacks weights for {', '.join(missing[:4])}"
                         f"{' …' if len(missing) > 4 else ''}")


def _copy_part(file: Path, name: str, place, param: torch.Tensor) -> int:
    """Copy this rank's part of one tensor into `param`; returns the rows it fills. The file
    is mapped for this tensor alone: mapped pages count as the process's memory until unmapped,
    so one mapping per file would hold a whole shard file beside the model."""
    if place.index is None:
        return param.shape[0]
    with open_checkpoint(file) as f:
        whole = f.get_slice(name)
        part = whole[place.index]
        if part.shape[1:] != param.shape[1:] or place.offset + part.shape[0] > param.shape[0]:
            raise ValueError(f"weight {name} in {file.name} has shape "
                             f"{tuple(whole.get_shape())}, which does not fit {place.target} "
                             f"{tuple(param.shape)}")
        param.narrow(0, place.offset, part.shape[0]).copy_(part)
        return part.shape[0]


def eos_token_ids(model_dir: Path, tokenizer) -> frozenset[int]:
    """EOS ids from generation_config.json (int or list) plus the tokenizer's own."""
    ids: set[int] = set()
    path = model_dir / "generation_config.json"
    if path.exists():
        eos = read_json_object(path).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
