"""Pre-quantized checkpoints (AWQ, GPTQ, compressed-tensors, FP8) built from tiny float models.

An independent implementation of each published format, written from its definition
(shared/reference/adapters-quant-spec.md, section 2); nothing here imports from `engine/`.

* `quantize_folder` rounds the decoder Linear weights of a float32 transformers folder and
  writes them packed in one format, with `quantization_config` in config.json.
* `dequantized_folder` decodes such a folder *from its packed tensors* back into a plain float32
  transformers folder: the reference that transformers `generate` runs on.
* `activation_fake_quant` adds the FP8 activation quantize-dequantize of a checkpoint to that
  reference model, as forward pre-hooks.

Rounding conventions (all round-half-to-even, as `torch.round`):

* Integer scales are rounded to float16 *before* the codes are computed, and rounded up
  (to the next float16 when float16 rounding went down), so no code is ever clamped by the
  scale's rounding and the dequantized reference is exactly what a loader computes in float32:
  ``(q - z) * float32(scale_fp16)``.
* Asymmetric int (AWQ; GPTQ and compressed-tensors with ``sym=False``), per group and output:
  ``lo = min(w.min(), 0)``, ``hi = max(w.max(), 0)`` (the range always holds 0, as GPTQ's
  quantizer does), ``scale = max(hi - lo, 1e-5) / (2^b - 1)``, ``z = clamp(round(-lo / scale),
  0, 2^b - 1)``, ``q = clamp(round(w / scale) + z, 0, 2^b - 1)``; ``|w - (q - z)·scale| <=
  scale / 2``. GPTQ v1 cannot store a zero point of 0 (it stores z - 1), so v1 clamps z to >= 1.
* Symmetric int: ``scale = max(max|w|, 1e-5) / (2^(b-1) - 1)`` (int4: amax / 7), zero point
  ``2^(b-1)`` (unsigned codes; int4: 8), ``q = round(w / scale) + 2^(b-1)``, so codes lie in
  ``[1, 2^b - 1]`` and the most negative code is never used. compressed-tensors stores the
  signed code ``q - 2^(b-1)`` as ``signed + 2^(b-1)``, i.e. the same unsigned number; its
  asymmetric zero point is likewise signed ``z - 2^(b-1)`` stored as ``z``.
* FP8 (e4m3fn, max 448): ``scale = max(amax, 1e-12) / 448`` in float32 per tensor, channel or
  block, ``w_fp8 = (w / scale).clamp(-448, 448).to(float8_e4m3fn)``, dequant
  ``w_fp8.float() * scale``.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMATS = ("awq", "gptq", "ct-int", "fp8", "ct-fp8")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column 8c + AWQ_ORDER[i]
FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
ACT_SCALE_MIN = 1e-12  # floor of dynamic activation scales (all-zero rows/groups)
_INT_SCALE_MIN = 1e-5
_FP8_AMAX_MIN = 1e-12
# MoE routers stay float in every format (vLLM builds them without a quant config)
_ROUTER_SUFFIXES = (".mlp.gate.weight", ".block_sparse_moe.gate.weight",
                    ".shared_expert_gate.weight")


# ---------------------------------------------------------------------------------------------
# Packing


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values held in int64 -> int32 with the same bits (two's complement)."""
    words = words.to(torch.int64) & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _to_uint(words: torch.Tensor) -> torch.Tensor:
    """int32 words -> their unsigned 32-bit values as int64."""
    return words.to(torch.int64) & 0xFFFFFFFF


def pack_bitstream(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack unsigned `bits`-bit codes of a 2-D tensor along `dim` as a little-endian bit stream.

    Element ``l`` along `dim` occupies global bits ``bits*l .. bits*l + bits - 1`` of its
    column's (or row's) stream; bit ``j`` of the stream is bit ``j % 32`` of word ``j // 32``.
    Values may straddle two words (3-bit). The stream is zero-padded to whole words, so the
    packed length along `dim` is ``ceil(L * bits / 32)``. Returns int32.
    """
    codes = codes.to(torch.int64)
    if dim == 1:
        return pack_bitstream(codes.t(), bits, 0).t().contiguous()
    if int(codes.min()) < 0 or int(codes.max()) >= 2**bits:
        raise ValueError(f"codes out of range for {bits} bits")
    length, cols = codes.shape
    shifts = torch.arange(bits, dtype=torch.int64)
    stream = ((codes[:, None, :] >> shifts[None, :, None]) & 1).reshape(length * bits, cols)
    n_words = -(-length * bits // 32)
    stream = torch.cat([stream, stream.new_zeros(n_words * 32 - length * bits, cols)])
    weights = torch.arange(32, dtype=torch.int64)
    words = (stream.reshape(n_words, 32, cols) << weights[None, :, None]).sum(dim=1)
    return _to_int32(words)


def unpack_bitstream(words: torch.Tensor, bits: int, length: int, dim: int) -> torch.Tensor:
    """Inverse of `pack_bitstream`: the first `length` `bits`-bit codes along `dim` (int64)."""
    if dim == 1:
        return unpack_bitstream(words.t(), bits, length, 0).t().contiguous()
    n_words, cols = words.shape
    if n_words * 32 < length * bits:
        raise ValueError(f"{n_words} words cannot hold {length} codes of {bits} bits")
    shifts = torch.arange(32, dtype=torch.int64)
    stream = ((_to_uint(words)[:, None, :] >> shifts[None, :, None]) & 1).reshape(-1, cols)
    stream = stream[: length * bits].reshape(length, bits, cols)
    return (stream << torch.arange(bits, dtype=torch.int64)[None, :, None]).sum(dim=1)


def pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes [R, N] along the output dim, AWQ GEMM order: int32 [R, N/8].

    Nibble ``i`` (bits ``4i .. 4i+3``) of word ``c`` holds column ``8c + AWQ_ORDER[i]``.
    """
    rows, n = codes.shape
    if n % 8:
        raise ValueError(f"AWQ needs out_features divisible by 8, got {n}")
    codes = codes.to(torch.int64).reshape(rows, n // 8, 8)
    if int(codes.min()) < 0 or int(codes.max()) > 15:
        raise ValueError("AWQ codes must be 0..15")
    words = torch.zeros(rows, n // 8, dtype=torch.int64)
    for i, col in enumerate(AWQ_ORDER):
        words |= codes[:, :, col] << (4 * i)
    return _to_int32(words)


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_awq`: int32 [R, N/8] -> codes int64 [R, N]."""
    rows, n_words = words.shape
    uw = _to_uint(words)
    out = torch.zeros(rows, n_words, 8, dtype=torch.int64)
    for i, col in enumerate(AWQ_ORDER):
        out[:, :, col] = (uw >> (4 * i)) & 0xF
    return out.reshape(rows, n_words * 8)


# ---------------------------------------------------------------------------------------------
# Rounding


def _fp16_scale(scale: torch.Tensor) -> torch.Tensor:
    """Scale rounded to a positive float16 that is >= the float32 value (next float16 up)."""
    scale = scale.float().clamp_min(2.0**-14)  # smallest normal float16
    s16 = scale.to(torch.float16)
    low = s16.float() < scale
    bumped = (s16.view(torch.int16) + 1).view(torch.float16)  # positive: next representable
    return torch.where(low, bumped, s16)


def _group_reduce(wt: torch.Tensor, g_idx: torch.Tensor, n_groups: int, op: str) -> torch.Tensor:
    """Reduce Wᵀ [K, N] over the rows of each group: [n_groups, N]."""
    fill = float("-inf") if op == "amax" else float("inf")
    out = wt.new_full((n_groups, wt.shape[1]), fill)
    index = g_idx.to(torch.int64)[:, None].expand_as(wt)
    return out.scatter_reduce(0, index, wt, reduce=op, include_self=True)


def _int_quantize(wt: torch.Tensor, g_idx: torch.Tensor, n_groups: int, bits: int, sym: bool,
                  min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round Wᵀ [K, N] per (group, output): (codes int64 [K,N], zeros int64 [G,N], scales fp16).

    Codes and zeros are unsigned in ``[0, 2^b - 1]``; dequant ``(q - z[g_idx]) * s[g_idx]``.
    """
    maxq = 2**bits - 1
    wt = wt.float()
    if sym:
        amax = _group_reduce(wt.abs(), g_idx, n_groups, "amax")
        scale = _fp16_scale(amax.clamp_min(_INT_SCALE_MIN) / (2 ** (bits - 1) - 1))
        zeros = torch.full_like(amax, 2 ** (bits - 1), dtype=torch.int64)
    else:
        lo = _group_reduce(wt, g_idx, n_groups, "amin").clamp_max(0.0)
        hi = _group_reduce(wt, g_idx, n_groups, "amax").clamp_min(0.0)
        scale = _fp16_scale((hi - lo).clamp_min(_INT_SCALE_MIN) / maxq)
        zeros = torch.round(-lo / scale.float()).clamp(min_zero, maxq).to(torch.int64)
    s_rows = scale.float()[g_idx.long()]
    codes = torch.round(wt / s_rows) + zeros[g_idx.long()]
    return codes.clamp(0, maxq).to(torch.int64), zeros, scale


def _fp8_quantize(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 codes of W for an already broadcast float32 scale."""
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _block_expand(scale: torch.Tensor, shape: tuple[int, ...],
                  block: tuple[int, int]) -> torch.Tensor:
    """Block scales [ceil(N/bn), ceil(K/bk)] -> one per element [N, K]."""
    bn, bk = block
    n, k = shape
    return scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]


def _block_amax(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """max|w| per [bn, bk] block (edge blocks partial): [ceil(N/bn), ceil(K/bk)]."""
    bn, bk = block
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    padded = w.abs().float().new_zeros(nb * bn, kb * bk)
    padded[:n, :k] = w.abs().float()
    return padded.reshape(nb, bn, kb, bk).amax(dim=(1, 3))


def _fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    return (amax.float().clamp_min(_FP8_AMAX_MIN) / FP8_MAX).to(torch.float32)


# ---------------------------------------------------------------------------------------------
# Folders


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    if not tensors:
        raise FileNotFoundError(f"no safetensors in {folder}")
    return tensors


def _copy_side_files(src: Path, dst: Path) -> None:
    """Everything but the weights and config.json (tokenizer, generation config, template)."""
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if (path.is_file() and path.name != "config.json" and path.suffix != ".safetensors"
                and path.name != "model.safetensors.index.json"):
            shutil.copy2(path, dst / path.name)


def _write(dst: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})


def matches_ignore(module: str, patterns: tuple[str, ...] | list[str]) -> bool:
    """Whether a module name is skipped: an entry equal to it or to a dotted suffix of it
    (``"lm_head"``, ``"self_attn.q_proj"``), or ``"re:<regex>"`` matched (``re.match``) at its
    start, as compressed-tensors does."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], module):
                return True
        elif module == pattern or module.endswith("." + pattern):
            return True
    return False


def _targets(tensors: dict[str, torch.Tensor], ignore: tuple[str, ...],
             with_lm_head: bool) -> list[str]:
    """Module prefixes to quantize: 2-D `.weight` of decoder layers (not MoE routers), plus
    `lm_head` when present, allowed and not ignored."""
    out = []
    for name, t in tensors.items():
        if not name.endswith(".weight") or t.dim() != 2 or name.endswith(_ROUTER_SUFFIXES):
            continue
        module = name[: -len(".weight")]
        in_layers = ".layers." in name and "embed" not in name
        if not (in_layers or (with_lm_head and module == "lm_head")):
            continue
        if not matches_ignore(module, ignore):
            out.append(module)
    return sorted(out)


def _make_g_idx(k: int, group: int, desc_act: bool, gen: torch.Generator) -> torch.Tensor:
    """``k // G``; with desc_act a seeded random permutation (each group keeps G rows)."""
    base = torch.arange(k, dtype=torch.int32) // group
    if not desc_act:
        return base
    perm = torch.randperm(k, generator=gen)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = base
    return g_idx


def _group_of(k: int, group_size: int) -> int:
    group = k if group_size == -1 else group_size
    if group <= 0 or k % group:
        raise ValueError(f"in_features {k} is not a multiple of group_size {group_size}")
    return group


def _calibration_scale(k: int, gen: torch.Generator) -> torch.Tensor:
    """A fixed static activation scale: 4 * max|x| of 64 randn rows / 448 (float32 scalar).
    Headroom of 4x so real activations rarely clip."""
    x = torch.randn(64, k, generator=gen)
    return (4.0 * x.abs().amax() / FP8_MAX).to(torch.float32)


def quantize_folder(src: Path, dst: Path, fmt: str, *, bits: int = 4, group_size: int = 32,
                    sym: bool = True, desc_act: bool = False, checkpoint_format: str = "gptq",
                    block: tuple[int, int] | None = (32, 32), strategy: str | None = None,
                    activations: str | None = "dynamic", ignore: tuple[str, ...] = ("lm_head",),
                    seed: int = 0) -> Path:
    """Write a pre-quantized copy of the float transformers folder `src` into `dst`; returns dst.

    fmt:
      * ``"awq"``: AWQ GEMM, 4-bit, asymmetric (``zero_point: true``); `sym` and `bits` must be
        left at their defaults or agree (bits=4). lm_head is never quantized (AutoAWQ).
      * ``"gptq"``: `bits` in {2, 3, 4, 8}, `group_size` (-1 = one group), `sym`, `desc_act`
        (seeded random permuted g_idx), `checkpoint_format` "gptq" (v1, stores z - 1) or
        "gptq_v2". ``"lm_head": true`` in the config when lm_head is quantized.
      * ``"ct-int"``: compressed-tensors pack-quantized, `strategy` "group" (default) or
        "channel"; `desc_act` writes ``actorder: "group"`` and ``weight_g_idx``; scales fp16.
      * ``"fp8"``: ``quant_method: "fp8"``. `block` (bn, bk) gives the block form with
        ``weight_scale_inv``; ``block=None`` the per-tensor form with a 0-d ``weight_scale``
        (and a 0-d ``input_scale`` when ``activations="static"``). Block form: dynamic only.
      * ``"ct-fp8"``: compressed-tensors float-quantized, `strategy` "channel" (default),
        "tensor" or "block" (uses `block`). `activations` "dynamic" (per token; per 1×bk group
        for "block"), "static" (per tensor, ``input_scale`` [1]) or None (weight only).

    Int formats are weight-only and ignore `activations`. Modules matching `ignore`
    (`matches_ignore`) keep their float ``weight``; all other tensors are copied unchanged.
    `seed` drives the desc_act permutation and the static activation calibration.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; one of {FORMATS}")
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    tensors = _read_tensors(src)
    gen = torch.Generator().manual_seed(seed)
    ignore = tuple(ignore)
    out = dict(tensors)
    targets = _targets(tensors, ignore, with_lm_head=fmt != "awq")
    if activations not in ("dynamic", "static", None):
        raise ValueError(f"activations must be 'dynamic', 'static' or None, not {activations!r}")

    if fmt == "awq":
        if bits != 4:
            raise ValueError("AWQ GEMM is 4-bit")
        for module in targets:
            w = out.pop(module + ".weight")
            n, k = w.shape
            group = _group_of(k, group_size)
            g_idx = torch.arange(k) // group
            codes, zeros, scales = _int_quantize(w.t(), g_idx, k // group, 4, sym=False)
            out[module + ".qweight"] = pack_awq(codes)
            out[module + ".qzeros"] = pack_awq(zeros)
            out[module + ".scales"] = scales
        extra = [p for p in ignore if p != "lm_head"]
        qconfig: dict[str, Any] = {
            "quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
            "version": "gemm", "modules_to_not_convert": extra or None}

    elif fmt == "gptq":
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise ValueError(f"checkpoint_format must be gptq or gptq_v2, not {checkpoint_format}")
        v1 = checkpoint_format == "gptq"
        for module in targets:
            w = out.pop(module + ".weight")
            n, k = w.shape
            if (k * bits) % 32 or (n * bits) % 32:
                raise ValueError(f"{module}: K*bits and N*bits must be multiples of 32")
            group = _group_of(k, group_size)
            g_idx = _make_g_idx(k, group, desc_act, gen)
            codes, zeros, scales = _int_quantize(w.t(), g_idx, k // group, bits, sym,
                                                 min_zero=1 if v1 else 0)
            stored = zeros - 1 if v1 else zeros
            out[module + ".qweight"] = pack_bitstream(codes, bits, dim=0)
            out[module + ".qzeros"] = pack_bitstream(stored, bits, dim=1)
            out[module + ".scales"] = scales
            out[module + ".g_idx"] = g_idx
        qconfig = {"quant_method": "gptq", "bits": bits, "group_size": group_size,
                   "desc_act": desc_act, "sym": sym, "damp_percent": 0.01,
                   "true_sequential": True, "static_groups": False,
                   "checkpoint_format": checkpoint_format, "lm_head": "lm_head" in targets}

    elif fmt == "ct-int":
        strategy = strategy or "group"
        if strategy not in ("group", "channel"):
            raise ValueError(f"ct-int strategy must be group or channel, not {strategy}")
        offset = 2 ** (bits - 1)
        for module in targets:
            w = out.pop(module + ".weight")
            n, k = w.shape
            group = k if strategy == "channel" else _group_of(k, group_size)
            g_idx = _make_g_idx(k, group, desc_act and strategy == "group", gen)
            codes, zeros, scales = _int_quantize(w.t(), g_idx, k // group, bits, sym)
            # unsigned code q_u = signed + 2^(b-1): stored as is
            out[module + ".weight_packed"] = pack_bitstream(codes.t(), bits, dim=1)
            out[module + ".weight_scale"] = scales.t().contiguous()  # [N, K/G]
            out[module + ".weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
            if not sym:
                signed_zp = zeros.t() - offset  # [N, K/G]
                out[module + ".weight_zero_point"] = pack_bitstream(signed_zp + offset, bits, 0)
            if desc_act and strategy == "group":
                out[module + ".weight_g_idx"] = g_idx
        weights = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": strategy,
                   "group_size": group_size if strategy == "group" else None,
                   "dynamic": False,
                   "actorder": "group" if desc_act and strategy == "group" else None}
        qconfig = _ct_config("pack-quantized", weights, None, ignore)

    elif fmt == "fp8":
        if activations is None:
            raise ValueError("quant_method fp8 always quantizes activations (dynamic or static)")
        if block is not None and activations != "dynamic":
            raise ValueError("block-wise fp8 supports only dynamic activations")
        for module in targets:
            w = out.pop(module + ".weight")
            if block is not None:
                sinv = _fp8_scale(_block_amax(w, block))
                out[module + ".weight"] = _fp8_quantize(w, _block_expand(sinv, w.shape, block))
                out[module + ".weight_scale_inv"] = sinv
            else:
                scale = _fp8_scale(w.abs().amax())
                out[module + ".weight"] = _fp8_quantize(w, scale)
                out[module + ".weight_scale"] = scale.reshape(())
                if activations == "static":
                    out[module + ".input_scale"] = _calibration_scale(w.shape[1], gen).reshape(())
        qconfig = {"quant_method": "fp8", "activation_scheme": activations, "fmt": "e4m3"}
        if block is not None:
            qconfig["weight_block_size"] = list(block)
        qconfig["modules_to_not_convert"] = list(ignore)
        qconfig["ignored_layers"] = list(ignore)

    else:  # ct-fp8
        strategy = strategy or "channel"
        if strategy not in ("channel", "tensor", "block"):
            raise ValueError(f"ct-fp8 strategy must be channel, tensor or block, not {strategy}")
        if strategy == "block" and (block is None or activations == "static"):
            raise ValueError("ct-fp8 block strategy needs `block` and dynamic activations")
        for module in targets:
            w = out.pop(module + ".weight")
            if strategy == "channel":
                scale = _fp8_scale(w.abs().amax(dim=1, keepdim=True))  # [N, 1]
                full = scale
            elif strategy == "tensor":
                scale = _fp8_scale(w.abs().amax()).reshape(1)  # [1]
                full = scale
            else:
                assert block is not None
                scale = _fp8_scale(_block_amax(w, block))
                full = _block_expand(scale, w.shape, block)
            out[module + ".weight"] = _fp8_quantize(w, full)
            out[module + ".weight_scale"] = scale
            if activations == "static":
                out[module + ".input_scale"] = _calibration_scale(w.shape[1], gen).reshape(1)
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy,
                   "dynamic": False}
        if strategy == "block":
            assert block is not None
            weights["block_structure"] = list(block)
        acts: dict[str, Any] | None
        if activations == "dynamic":
            acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                    "dynamic": True}
            if strategy == "block":
                assert block is not None
                acts.update(strategy="group", group_size=block[1])
        elif activations == "static":
            acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor",
                    "dynamic": False}
        else:
            acts = None
        qconfig = _ct_config("float-quantized", weights, acts, ignore)

    _copy_side_files(src, dst)
    config["quantization_config"] = qconfig
    _write(dst, config, out)
    return dst


def _ct_config(fmt: str, weights: dict[str, Any], acts: dict[str, Any] | None,
               ignore: tuple[str, ...]) -> dict[str, Any]:
    return {"quant_method": "compressed-tensors", "format": fmt,
            "quantization_status": "compressed", "ignore": list(ignore),
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts,
                                          "output_activations": None}}}


# ---------------------------------------------------------------------------------------------
# Decoding


def _ct_group(qconfig: dict[str, Any]) -> dict[str, Any]:
    groups = list(qconfig["config_groups"].values())
    if len(groups) != 1:
        raise ValueError("only single-group compressed-tensors configs are supported")
    return groups[0]


def dequantize_tensors(tensors: dict[str, torch.Tensor],
                       qconfig: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Decode every quantized module of a checkpoint's tensors into a float32 ``weight`` [N, K]
    (computed in float32 from the packed tensors); other tensors are returned unchanged, and
    scale/packing tensors (incl. ``input_scale``) are dropped."""
    method = qconfig["quant_method"]
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        used.add(name)
        return tensors[name]

    if method == "awq":
        for name in [n for n in tensors if n.endswith(".qweight")]:
            p = name[: -len(".qweight")]
            q = unpack_awq(take(p + ".qweight"))  # [K, N]
            z = unpack_awq(take(p + ".qzeros"))  # [K/G, N]
            s = take(p + ".scales").float()
            k = q.shape[0]
            g = torch.arange(k) // (k // s.shape[0])
            out[p + ".weight"] = ((q - z[g]).float() * s[g]).t().contiguous()
    elif method == "gptq":
        bits = int(qconfig["bits"])
        v1 = qconfig.get("checkpoint_format", "gptq") == "gptq"
        for name in [n for n in tensors if n.endswith(".qweight")]:
            p = name[: -len(".qweight")]
            s = take(p + ".scales").float()  # [G, N]
            n_out = s.shape[1]
            qw = take(p + ".qweight")
            k = qw.shape[0] * 32 // bits
            q = unpack_bitstream(qw, bits, k, dim=0)  # [K, N]
            z = unpack_bitstream(take(p + ".qzeros"), bits, n_out, dim=1)  # [G, N]
            if v1:
                z = z + 1
            if p + ".g_idx" in tensors:
                g = take(p + ".g_idx").long()
            else:
                g = torch.arange(k) // (k // s.shape[0])
            out[p + ".weight"] = (s[g] * (q - z[g]).float()).t().contiguous()
    elif method == "compressed-tensors" and qconfig["format"] == "pack-quantized":
        wcfg = _ct_group(qconfig)["weights"]
        bits = int(wcfg["num_bits"])
        offset = 2 ** (bits - 1)
        for name in [n for n in tensors if n.endswith(".weight_packed")]:
            p = name[: -len(".weight_packed")]
            n_out, k = (int(v) for v in take(p + ".weight_shape").tolist())
            q = unpack_bitstream(take(p + ".weight_packed"), bits, k, dim=1) - offset  # signed
            s = take(p + ".weight_scale").float()  # [N, n_groups]
            if p + ".weight_zero_point" in tensors:
                zp = unpack_bitstream(take(p + ".weight_zero_point"), bits, n_out, dim=0) - offset
            else:
                zp = torch.zeros_like(s, dtype=torch.int64)
            if p + ".weight_g_idx" in tensors:
                g = take(p + ".weight_g_idx").long()
            else:
                g = torch.arange(k) // (k // s.shape[1])
            out[p + ".weight"] = (q - zp[:, g]).float() * s[:, g]
    elif method == "fp8" or (method == "compressed-tensors"
                             and qconfig["format"] == "float-quantized"):
        block = qconfig.get("weight_block_size")
        if method != "fp8" and _ct_group(qconfig)["weights"]["strategy"] == "block":
            block = _ct_group(qconfig)["weights"]["block_structure"]
        for name in [n for n in tensors if n.endswith(".weight") and tensors[n].dtype == FP8_DTYPE]:
            p = name[: -len(".weight")]
            w = take(name).float()
            if p + ".weight_scale_inv" in tensors:
                scale = take(p + ".weight_scale_inv").float()
                if scale.dim() == 2:
                    assert block is not None
                    scale = _block_expand(scale, tuple(w.shape), (block[0], block[1]))
            else:
                scale = take(p + ".weight_scale").float()
                if scale.dim() == 2 and scale.shape[1] != 1:  # ct block
                    assert block is not None
                    scale = _block_expand(scale, tuple(w.shape), (block[0], block[1]))
            out[p + ".weight"] = w * scale
            if p + ".input_scale" in tensors:
                used.add(p + ".input_scale")
    else:
        raise ValueError(f"unsupported quantization_config {qconfig}")
    for name, t in tensors.items():
        if name not in used and name not in out:
            out[name] = t
    return out


def dequantized_folder(quantized: Path, dst: Path) -> Path:
    """Decode a folder written by `quantize_folder` into a plain float32 transformers folder.

    The Linear weights are decoded from the packed tensors (not from any float copy), in
    float32 by the format's formula; config.json loses ``quantization_config``. Returns dst.
    """
    quantized, dst = Path(quantized), Path(dst)
    config = json.loads((quantized / "config.json").read_text())
    qconfig = config.pop("quantization_config")
    tensors = dequantize_tensors(_read_tensors(quantized), qconfig)
    _copy_side_files(quantized, dst)
    _write(dst, config, tensors)
    return dst


# ---------------------------------------------------------------------------------------------
# Activations


def fp8_fake_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(x.float() / scale).clamp(-448, 448).to(float8_e4m3fn).float() * scale`` in x.dtype."""
    return ((x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * scale).to(x.dtype)


def dynamic_scale(x: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """Dynamic activation scale, float32, broadcastable to x.

    ``group=None``: per token, ``(x.float().abs().amax(-1, keepdim=True) / 448)
    .clamp_min(1e-12)``. ``group=g``: the same per 1×g group of the last dim (the last group
    may be partial), expanded back to x's shape.
    """
    xf = x.float().abs()
    if group is None:
        return (xf.amax(-1, keepdim=True) / FP8_MAX).clamp_min(ACT_SCALE_MIN)
    k = x.shape[-1]
    n_groups = -(-k // group)
    padded = torch.nn.functional.pad(xf, (0, n_groups * group - k))
    amax = padded.reshape(*x.shape[:-1], n_groups, group).amax(-1)
    scale = (amax / FP8_MAX).clamp_min(ACT_SCALE_MIN)
    return scale.repeat_interleave(group, dim=-1)[..., :k]


def _activation_plan(qconfig: dict[str, Any]) -> tuple[str, int | None] | None:
    """("dynamic", group or None) / ("static", None) / None for no activation quantization."""
    method = qconfig.get("quant_method")
    if method == "fp8":
        if qconfig.get("activation_scheme", "dynamic") == "static":
            return ("static", None)
        block = qconfig.get("weight_block_size")
        return ("dynamic", int(block[1]) if block else None)
    if method == "compressed-tensors" and qconfig.get("format") == "float-quantized":
        acts = _ct_group(qconfig).get("input_activations")
        if not acts:
            return None
        if not acts.get("dynamic", False):
            return ("static", None)
        if acts.get("strategy") == "group":
            return ("dynamic", int(acts["group_size"]))
        return ("dynamic", None)
    return None


def activation_fake_quant(model: torch.nn.Module, quantized: Path) -> list[Any]:
    """Quantize-dequantize the inputs of `model`'s FP8-quantized Linears as the checkpoint says.

    `model` is the float reference (e.g. loaded from `dequantized_folder`); module names must
    match the checkpoint's (``model.layers.0.self_attn.q_proj``). A forward pre-hook on each
    module whose weight is FP8 in `quantized` replaces its input x by::

        x_q = (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
        x_q = x_q.to(x.dtype)

    with scale float32:

    * dynamic per token (compressed-tensors ``strategy: "token"``, and the per-tensor form of
      ``quant_method: "fp8"`` with dynamic activations):
      ``scale = (x.float().abs().amax(-1, keepdim=True) / 448).clamp_min(1e-12)``
    * dynamic per 1×bk group (``quant_method: "fp8"`` with ``weight_block_size [bn, bk]``;
      compressed-tensors ``strategy: "group"``): the same amax over each run of bk consecutive
      elements of the last dim.
    * static: ``scale = input_scale`` of that module from the checkpoint.

    Int formats and weight-only FP8 return no hooks. Returns the hook handles (``.remove()``).
    """
    quantized = Path(quantized)
    qconfig = json.loads((quantized / "config.json").read_text()).get("quantization_config", {})
    plan = _activation_plan(qconfig)
    if plan is None:
        return []
    kind, group = plan
    tensors = _read_tensors(quantized)
    modules = dict(model.named_modules())
    handles = []
    for name, t in tensors.items():
        if not name.endswith(".weight") or t.dtype != FP8_DTYPE:
            continue
        prefix = name[: -len(".weight")]
        if prefix not in modules:
            raise KeyError(f"model has no module {prefix}")
        if kind == "static":
            static = tensors[prefix + ".input_scale"].float().reshape(())

            def hook(_mod: torch.nn.Module, args: tuple[Any, ...],
                     static: torch.Tensor = static) -> tuple[Any, ...]:
                return (fp8_fake_quant(args[0], static.to(args[0].device)), *args[1:])
        else:
            def hook(_mod: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
                return (fp8_fake_quant(args[0], dynamic_scale(args[0], group)), *args[1:])
        handles.append(modules[prefix].register_forward_pre_hook(hook))
    return handles
