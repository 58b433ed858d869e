"""Which layers attend within a sliding window, by the record's window rule (registry.py), as
transformers derives it when config.json has no `layer_types`. One place for the rules, so a
record picks one by name and no implementation tests architecture names."""

from __future__ import annotations

from typing import Any

from engine.models.registry import model_record

KINDS = ("full_attention", "sliding_attention")


def layer_windows(arch: str, config: dict[str, Any]) -> list[int | None]:
    """Each layer's attention window (None: every earlier position) for the llama family's
    rules: `every_layer` slides on every layer when the config has a window; `qwen` only with
    use_sliding_window, on layers >= max_window_layers (`qwen2_moe`: odd-numbered layers below
    it). ValueError on a layer type the native modules do not run."""
    rule = model_record(arch).windows
    count, window = config["num_hidden_layers"], config.get("sliding_window")
    qwen = rule in ("qwen", "qwen2_moe")
    if not window or not config.get("use_sliding_window", not qwen):
        return [None] * count
    kinds = config.get("layer_types")
    if kinds is None and qwen:
        limit = config.get("max_window_layers", 28)
        odd = rule == "qwen2_moe"
        kinds = ["sliding_attention" if ((i + 1) % 2 and i < limit if odd else i >= limit)
                 else "full_attention" for i in range(count)]
    kinds = kinds or ["sliding_attention"] * count
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"its layer types {sorted(unknown)}")
    return [window if kind == "sliding_attention" else None for kind in kinds]


def layer_types(config: dict[str, Any]) -> list[str]:
    """Each layer's attention for the gemma family's rules: "full_attention" or
    "sliding_attention" (`alternating`: one full layer in every `sliding_window_pattern`,
    from a sliding first layer; `none`: full everywhere); config.json's own list wins."""
    count = config["num_hidden_layers"]
    if config.get("layer_types"):
        return list(config["layer_types"])
    record = model_record(config["architectures"][0])
    if config.get("sliding_window") is None or record.windows != "alternating":
        return ["full_attention"] * count
    pattern = config.get("sliding_window_pattern") or record.window_pattern
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(count)]
