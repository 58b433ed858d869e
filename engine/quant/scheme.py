"""What a checkpoint's `quantization_config` (config.json) says, read once into a frozen
QuantScheme: the format of its tensors, bits, groups, zero points, activation scales. Every
field a loader cannot serve is refused here, at start-up, by its name."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import QUANTIZE_ALIASES

# option.quantize → the checkpoint formats it may name (a mismatch stops start-up)
OPTION_FORMATS = {"awq": ("awq",), "gptq": ("gptq",), "fp8": ("fp8", "ct-fp8"),
                  "compressed-tensors": ("ct-int", "ct-fp8")}
FP8_MAX = 448.0  # largest float8_e4m3fn value


@dataclass(frozen=True)
class ActQuant:
    """How activations are quantized before an FP8 matmul: `token` (dynamic, one scale per
    row), `group` (dynamic, one per `group` columns of a row), `static` (the checkpoint's
    input_scale)."""

    kind: str
    group: int = 0


@dataclass(frozen=True)
class QuantScheme:
    """One checkpoint's quantization. fmt: awq, gptq, ct-int (compressed-tensors
    pack-quantized), fp8 (transformers' fp8), ct-fp8 (compressed-tensors float-quantized).
    group_size None: one group per row (per channel). zero_offset: added to stored zero points
    (GPTQ v1 stores zero - 1)."""

    fmt: str
    bits: int
    group_size: int | None = None
    symmetric: bool = True
    zero_offset: int = 0
    desc_act: bool = False
    weight_block: tuple[int, int] | None = None  # fp8 block scales [rows, columns]
    activations: ActQuant | None = None  # None: weight-only
    ignore: tuple[str, ...] = ()

    @property
    def is_float(self) -> bool:
        return self.fmt in ("fp8", "ct-fp8")

    def describe(self) -> str:
        if self.is_float:
            act = self.activations.kind if self.activations else "none"
            block = f", blocks {self.weight_block}" if self.weight_block else ""
            return f"{self.fmt} (float8 e4m3 weights{block}, activations {act})"
        groups = f"group {self.group_size}" if self.group_size else "per channel"
        return f"{self.fmt} (int{self.bits}, {groups}, {'sym' if self.symmetric else 'asym'})"


def scheme_from_config(config: dict, option: str | None) -> QuantScheme | None:
    """The checkpoint's scheme (None: float weights); ValueError naming the field that cannot
    be served, or option.quantize and quant_method when they disagree."""
    raw = config.get("quantization_config")
    option = QUANTIZE_ALIASES.get(option, option) if option else None
    if raw is None:
        if option in ("awq", "gptq", "compressed-tensors"):
            raise ValueError(f"invalid quantize={option!r}: config.json has no "
                             "quantization_config; a pre-quantized checkpoint is needed (int8 and "
                             "fp8 quantize float weights at load)")
        return None
    if not isinstance(raw, dict):
        raise ValueError("config.json quantization_config must be an object")
    method = str(raw.get("quant_method", "")).lower()
    readers = {"awq": _awq, "gptq": _gptq, "fp8": _fp8, "compressed-tensors": _compressed}
    if method not in readers:
        raise ValueError(f"config.json quantization_config.quant_method={method!r} is not "
                         f"served: batchyard reads {', '.join(readers)}")
    scheme = readers[method](raw)
    if option is not None and scheme.fmt not in OPTION_FORMATS.get(option, ()):
        raise ValueError(f"option.quantize={option!r} does not match config.json "
                         f"quantization_config.quant_method={method!r}: leave option.quantize "
                         "unset to serve the checkpoint as published")
    return scheme


def _field(raw: dict, name: str, allowed, default=None):
    value = raw.get(name, default)
    if value not in allowed:
        raise ValueError(f"config.json quantization_config.{name}={value!r} is not served "
                         f"(served: {', '.join(map(repr, allowed))})")
    return value


def _group(raw: dict, name: str) -> int | None:
    value = raw.get(name, -1)
    if value is None or value == -1:
        return None
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"config.json quantization_config.{name}={value!r}: must be -1 or a "
                         "positive integer")
    return value


def _ignore(raw: dict, *names: str) -> tuple[str, ...]:
    for name in names:
        if raw.get(name):
            return tuple(str(x) for x in raw[name])
    return ()


def _awq(raw: dict) -> QuantScheme:
    # legacy AutoAWQ spellings (quant_config.json): w_bit, q_group_size
    bits = raw.get("bits", raw.get("w_bit", 4))
    if bits != 4:
        raise ValueError(f"config.json quantization_config.bits={bits!r}: AWQ is 4-bit")
    _field(raw, "version", ("gemm", "GEMM"), "gemm")
    _field(raw, "zero_point", (True,), True)
    group = _group({"group_size": raw.get("group_size", raw.get("q_group_size", -1))},
                   "group_size")
    return QuantScheme("awq", 4, group, symmetric=False,
                       ignore=_ignore(raw, "modules_to_not_convert"))


def _gptq(raw: dict) -> QuantScheme:
    bits = _field(raw, "bits", (2, 3, 4, 8), 4)
    form = _field(raw, "checkpoint_format", ("gptq", "gptq_v2"), "gptq")
    return QuantScheme("gptq", bits, _group(raw, "group_size"),
                       symmetric=bool(raw.get("sym", True)),
                       zero_offset=1 if form == "gptq" else 0,
                       desc_act=bool(raw.get("desc_act", False)))


def _fp8(raw: dict) -> QuantScheme:
    _field(raw, "fmt", ("e4m3",), "e4m3")
    act = _field(raw, "activation_scheme", ("dynamic", "static"), "dynamic")
    block = raw.get("weight_block_size")
    if block is not None:
        if (not isinstance(block, list) or len(block) != 2
                or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"config.json quantization_config.weight_block_size={block!r}: "
                             "must be [rows, columns]")
        if act != "dynamic":
            raise ValueError("config.json quantization_config: block-scaled fp8 needs "
                             "activation_scheme 'dynamic'")
        acts = ActQuant("group", block[1])
    else:
        acts = ActQuant("token" if act == "dynamic" else "static")
    return QuantScheme("fp8", 8, weight_block=tuple(block) if block else None,
                       activations=acts,
                       ignore=_ignore(raw, "ignored_layers", "modules_to_not_convert"))


def _compressed(raw: dict) -> QuantScheme:
    fmt = _field(raw, "format", ("pack-quantized", "float-quantized"))
    if raw.get("kv_cache_scheme"):
        raise ValueError("config.json quantization_config.kv_cache_scheme: a quantized KV cache "
                         "is not served (the KV pool holds the model's dtype)")
    _field(raw, "quantization_status", ("compressed",), "compressed")
    groups = raw.get("config_groups") or {}
    if not isinstance(groups, dict) or len(groups) != 1:
        raise ValueError(f"config.json quantization_config.config_groups: {len(groups)} "
                         "groups; batchyard serves exactly one scheme for every Linear")
    group = next(iter(groups.values()))
    weights = group.get("weights") or {}
    ignore = _ignore(raw, "ignore")
    if fmt == "pack-quantized":
        return _ct_int(weights, group, ignore)
    return _ct_float(weights, group, ignore)


def _ct_int(weights: dict, group: dict, ignore: tuple[str, ...]) -> QuantScheme:
    _field(weights, "type", ("int",))
    bits = _field(weights, "num_bits", (4, 8))
    strategy = _field(weights, "strategy", ("group", "channel", "tensor"))
    if group.get("input_activations"):
        raise ValueError("config.json quantization_config.config_groups: quantized input "
                         "activations with int weights (W8A8 int) are not served; W4A16 and "
                         "W8A16 are")
    size = _group(weights, "group_size") if strategy == "group" else None
    if strategy == "group" and size is None:
        raise ValueError("config.json quantization_config weights.group_size is needed with "
                         "strategy 'group'")
    actorder = _field(weights, "actorder", (None, "group", "weight", "static", "dynamic"), None)
    return QuantScheme("ct-int", bits, size, symmetric=bool(weights.get("symmetric", True)),
                       desc_act=actorder == "group", ignore=ignore)


def _ct_float(weights: dict, group: dict, ignore: tuple[str, ...]) -> QuantScheme:
    _field(weights, "type", ("float",))
    _field(weights, "num_bits", (8,))
    strategy = _field(weights, "strategy", ("tensor", "channel", "block"))
    block = None
    if strategy == "block":
        block = weights.get("block_structure")
        if not isinstance(block, list) or len(block) != 2:
            raise ValueError("config.json quantization_config weights.block_structure must be "
                             "[rows, columns] with strategy 'block'")
    acts = group.get("input_activations")
    act = None
    if acts:
        _field(acts, "type", ("float",))
        kind = _field(acts, "strategy", ("token", "tensor", "group"))
        dynamic = bool(acts.get("dynamic", False))
        if kind == "group":
            act = ActQuant("group", int(acts.get("group_size") or 128))
        elif dynamic:
            # NOTE: a dynamic per-tensor scale is taken per token, so a request's output does
            # not depend on the others in its batch
            act = ActQuant("token")
        elif kind == "tensor":
            act = ActQuant("static")
        else:
            raise ValueError("config.json quantization_config input_activations: static "
                             "per-token scales cannot exist; set dynamic true")
    return QuantScheme("ct-fp8", 8, weight_block=tuple(block) if block else None,
                       activations=act, ignore=ignore)
