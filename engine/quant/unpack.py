"""One checkpoint module's quantized tensors, decoded from its published layout into ours:
integer codes one per byte [N, K] with float32 scales and uint8 zero points per (row, group),
or float8 weights [N, K] with float32 scales per (row, column block). N = out_features,
K = in_features, G = group size. A tensor missing, mis-shaped or of the wrong dtype is refused
by name. The formats are those of ../shared/reference/adapters-quant-spec.md §2."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from engine.quant.scheme import QuantScheme

AWQ_UNDO = [0, 4, 1, 5, 2, 6, 3, 7]  # logical column j of 8 sits in nibble AWQ_UNDO[j]


@dataclass(frozen=True)
class IntWeights:
    """W[n, k] = (codes[n, k] - zeros[n, g]) * scales[n, g], g = g_idx[k] or k // group."""

    codes: torch.Tensor  # [N, K] uint8
    scales: torch.Tensor  # [N, groups] float (the checkpoint's dtype)
    zeros: torch.Tensor  # [N, groups] uint8
    group: int
    g_idx: torch.Tensor | None = None  # [K] int64, or [parts, K] (see bounds); None: k // group
    # a fused layer whose parts have their own g_idx: each part's first row, then the last + 1
    bounds: tuple[int, ...] | None = None

    def rows(self, index: slice) -> IntWeights:
        return replace(self, codes=self.codes[index], scales=self.scales[index],
                       zeros=self.zeros[index])

    def columns(self, index: slice, name: str) -> IntWeights:
        """This rank's input columns; without g_idx they must start and end on a group."""
        start, stop = index.start or 0, self.codes.shape[1] if index.stop is None else index.stop
        if self.g_idx is not None:
            return replace(self, codes=self.codes[:, index], g_idx=self.g_idx[index])
        if self.scales.shape[1] == 1:  # one scale per row: any cut keeps it
            return replace(self, codes=self.codes[:, index], group=stop - start)
        if start % self.group or (stop - start) % self.group:
            raise ValueError(f"{name}: this tensor-parallel split takes input columns "
                             f"{start}:{stop}, which cut quantization groups of {self.group}; "
                             "choose a degree whose share is a multiple of the group size")
        groups = slice(start // self.group, stop // self.group)
        return replace(self, codes=self.codes[:, index], scales=self.scales[:, groups],
                       zeros=self.zeros[:, groups])


@dataclass(frozen=True)
class FloatWeights:
    """W[n, k] = weight[n, k] * scales[n, k // block] (block = K: one scale per row)."""

    weight: torch.Tensor  # [N, K] float8_e4m3fn
    scales: torch.Tensor  # [N, ceil(K / block)] float32
    block: int
    input_scale: torch.Tensor | None = None  # [] or [parts] float32, static activations only
    bounds: tuple[int, ...] | None = None  # with one input scale per part: their first rows

    def rows(self, index: slice) -> FloatWeights:
        return replace(self, weight=self.weight[index], scales=self.scales[index])

    def columns(self, index: slice, name: str) -> FloatWeights:
        start, stop = index.start or 0, self.weight.shape[1] if index.stop is None else index.stop
        if start % self.block and self.block < self.weight.shape[1]:
            raise ValueError(f"{name}: this tensor-parallel split takes input columns "
                             f"{start}:{stop}, which cut its scale blocks of {self.block}")
        if self.block >= self.weight.shape[1]:  # one scale per row: every rank keeps it
            return replace(self, weight=self.weight[:, index], block=stop - start)
        blocks = slice(start // self.block, -(-stop // self.block))
        return replace(self, weight=self.weight[:, index], scales=self.scales[:, blocks])


Decoded = IntWeights | FloatWeights
# tensor suffixes each format stores per quantized module (besides bias)
FORMAT_TENSORS = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "ct-int": ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point",
               "weight_g_idx"),
    "fp8": ("weight", "weight_scale_inv", "weight_scale", "input_scale"),
    "ct-fp8": ("weight", "weight_scale", "input_scale"),
}
# the tensor whose presence marks a module as quantized in each format
MARKERS = {"awq": "qweight", "gptq": "qweight", "ct-int": "weight_packed",
           "fp8": "weight", "ct-fp8": "weight"}


def decode(scheme: QuantScheme, tensors: dict[str, torch.Tensor], name: str) -> Decoded:
    """tensors: suffix → tensor of module `name` (e.g. model.layers.0.mlp.up_proj)."""
    readers: dict[str, Callable[[QuantScheme, _Tensors], Decoded]] = {
        "awq": _awq, "gptq": _gptq, "ct-int": _ct_int, "fp8": _fp8, "ct-fp8": _ct_fp8}
    return readers[scheme.fmt](scheme, _Tensors(tensors, name))


class _Tensors:
    """A module's tensors that name themselves in errors."""

    def __init__(self, tensors: dict[str, torch.Tensor], name: str) -> None:
        self.tensors, self.name = tensors, name

    def get(self, suffix: str, dtypes: tuple[torch.dtype, ...],
            shape: tuple[int, ...] | None = None, required: bool = True) -> torch.Tensor:
        tensor = self.tensors.get(suffix)
        if tensor is None:
            if required:
                raise ValueError(f"the checkpoint lacks {self.name}.{suffix}")
            return None  # type: ignore[return-value]
        if suffix in MATRICES and tensor.dim() != 2:
            raise ValueError(f"{self.name}.{suffix} has {tensor.dim()} dimensions; expected 2")
        if tensor.dtype not in dtypes:
            raise ValueError(f"{self.name}.{suffix} is {tensor.dtype}; expected "
                             f"{' or '.join(map(str, dtypes))}")
        if shape is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"{self.name}.{suffix} has shape {tuple(tensor.shape)}; expected "
                             f"{shape}")
        return tensor


FLOATS = (torch.float16, torch.bfloat16, torch.float32)
MATRICES = {"qweight", "qzeros", "scales", "weight_packed", "weight", "weight_scale_inv"}


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 [..., W] holding a little-endian stream of `bits`-bit values along its last
    dimension → uint8 [..., count] (values straddle words where 32 % bits != 0)."""
    if 32 % bits == 0:
        shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
        values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., W, 32 / bits]
        return values.flatten(-2)[..., :count].to(torch.uint8)
    stream = packed.contiguous().view(torch.uint8)  # [..., 4 W] little-endian bytes
    one = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bit = ((stream.unsqueeze(-1) >> one) & 1).flatten(-2)  # [..., 32 W]
    bit = bit[..., :count * bits].unflatten(-1, (count, bits)).to(torch.int32)
    weights = 1 << torch.arange(bits, dtype=torch.int32, device=packed.device)
    return (bit * weights).sum(-1).to(torch.uint8)


def _words(values: int, bits: int) -> int:
    return -(-values * bits // 32)


def _groups(k: int, group: int | None, name: str) -> int:
    if group is None:
        return k
    if k % group:
        raise ValueError(f"{name}: quantization_config.group_size={group} does not divide its "
                         f"{k} input columns")
    return group


def _awq(scheme: QuantScheme, t: _Tensors) -> IntWeights:
    qweight = t.get("qweight", (torch.int32,))
    k, n = qweight.shape[0], qweight.shape[1] * 8
    group = _groups(k, scheme.group_size, t.name)
    ng = k // group
    qzeros = t.get("qzeros", (torch.int32,), (ng, n // 8))
    scales = t.get("scales", FLOATS, (ng, n))
    undo = torch.tensor(AWQ_UNDO)

    def columns(x: torch.Tensor) -> torch.Tensor:  # [R, N / 8] → [R, N] in logical order
        return unpack_bits(x, 4, x.shape[1] * 8).unflatten(1, (-1, 8))[..., undo].flatten(1)

    return IntWeights(columns(qweight).t().contiguous(), scales.t().contiguous(),
                      columns(qzeros).t().contiguous(), group)


def _gptq(scheme: QuantScheme, t: _Tensors) -> IntWeights:
    b = scheme.bits
    qweight = t.get("qweight", (torch.int32,))
    n = qweight.shape[1]
    g_idx = t.get("g_idx", (torch.int32, torch.int64), required=False)
    k = g_idx.shape[0] if g_idx is not None else qweight.shape[0] * 32 // b
    if qweight.shape[0] != _words(k, b):
        raise ValueError(f"{t.name}.qweight has {qweight.shape[0]} rows; {k} input columns of "
                         f"{b} bits pack into {_words(k, b)}")
    group = _groups(k, scheme.group_size, t.name) if g_idx is None or not scheme.desc_act \
        else scheme.group_size or k
    ng = -(-k // group)
    qzeros = t.get("qzeros", (torch.int32,), (ng, _words(n, b)))
    scales = t.get("scales", FLOATS, (ng, n))
    codes = unpack_bits(qweight.t().contiguous(), b, k)  # [N, K]
    zeros = unpack_bits(qzeros, b, n).to(torch.int32)  # [groups, N]
    zeros = ((zeros + scheme.zero_offset) & ((1 << b) - 1)).to(torch.uint8)
    return IntWeights(codes, scales.t().contiguous(), zeros.t().contiguous(), group,
                      _nontrivial(g_idx, group, ng, t.name))


def _nontrivial(g_idx: torch.Tensor | None, group: int, groups: int,
                name: str) -> torch.Tensor | None:
    """g_idx where it reorders (act-order), None where it is k // group."""
    if g_idx is None:
        return None
    g_idx = g_idx.long()
    if g_idx.min() < 0 or g_idx.max() >= groups:
        raise ValueError(f"{name}.g_idx names groups outside 0..{groups - 1}")
    plain = torch.arange(g_idx.shape[0]) // group
    return None if torch.equal(g_idx, plain) else g_idx


def _ct_int(scheme: QuantScheme, t: _Tensors) -> IntWeights:
    b = scheme.bits
    shape = t.get("weight_shape", (torch.int64, torch.int32), (2,))
    n, k = (int(x) for x in shape.tolist())
    packed = t.get("weight_packed", (torch.int32,), (n, _words(k, b)))
    group = _groups(k, scheme.group_size, t.name)
    ng = k // group
    scales = t.get("weight_scale", FLOATS)
    if tuple(scales.shape) in ((1,), (), (1, 1)) and group == k:  # strategy tensor
        scales = scales.reshape(1, 1).expand(n, 1)
    if tuple(scales.shape) != (n, ng):
        raise ValueError(f"{t.name}.weight_scale has shape {tuple(scales.shape)}; expected "
                         f"{(n, ng)}")
    codes = unpack_bits(packed, b, k)  # [N, K], stored as q + 2^(b-1)
    if scheme.symmetric:
        zeros = torch.full((n, ng), 1 << (b - 1), dtype=torch.uint8)
    else:
        point = t.get("weight_zero_point", (torch.int32,), (_words(n, b), ng))
        zeros = unpack_bits(point.t().contiguous(), b, n).t().contiguous()  # [N, groups]
    g_idx = t.get("weight_g_idx", (torch.int32, torch.int64), (k,), required=False)
    return IntWeights(codes, scales.contiguous(), zeros, group,
                      _nontrivial(g_idx, group, ng, t.name))


def _fp8(scheme: QuantScheme, t: _Tensors) -> FloatWeights:
    weight = t.get("weight", (torch.float8_e4m3fn,))
    n, k = weight.shape
    if scheme.weight_block is not None:
        bn, bk = scheme.weight_block
        inv = t.get("weight_scale_inv", (torch.float32, *FLOATS), (-(-n // bn), -(-k // bk)))
        return FloatWeights(weight, inv.float().repeat_interleave(bn, 0)[:n].contiguous(), bk)
    return _per_tensor(scheme, t, weight)


def _ct_fp8(scheme: QuantScheme, t: _Tensors) -> FloatWeights:
    weight = t.get("weight", (torch.float8_e4m3fn,))
    n, k = weight.shape
    if scheme.weight_block is not None:
        bn, bk = scheme.weight_block
        scale = t.get("weight_scale", FLOATS, (-(-n // bn), -(-k // bk)))
        return replace(_per_tensor(scheme, t, weight, need_scale=False),
                       scales=scale.float().repeat_interleave(bn, 0)[:n].contiguous(), block=bk)
    return _per_tensor(scheme, t, weight)


def _per_tensor(scheme: QuantScheme, t: _Tensors, weight: torch.Tensor,
                need_scale: bool = True) -> FloatWeights:
    """A scalar or per-row weight scale, and the static input scale where the scheme has one."""
    n, k = weight.shape
    scales = torch.ones(n, 1)
    if need_scale:
        scale = t.get("weight_scale", (torch.float32, *FLOATS))
        if scale.numel() == 1:
            scales = scale.float().reshape(1, 1).expand(n, 1).contiguous()
        elif tuple(scale.shape) in ((n, 1), (n,)):
            scales = scale.float().reshape(n, 1).contiguous()
        else:
            raise ValueError(f"{t.name}.weight_scale has shape {tuple(scale.shape)}; expected "
                             f"(1,) or {(n, 1)}")
    static = scheme.activations is not None and scheme.activations.kind == "static"
    input_scale = None
    if static:
        input_scale = t.get("input_scale", (torch.float32, *FLOATS))
        if input_scale.numel() != 1:
            raise ValueError(f"{t.name}.input_scale has shape {tuple(input_scale.shape)}; "
                             "expected one value")
        input_scale = input_scale.float().reshape(())
    return FloatWeights(weight, scales, k, input_scale)
