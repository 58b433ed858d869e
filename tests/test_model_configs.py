"""How native modules read config.json as the hub ships it (no `layer_types`, legacy keys), the
way transformers derives what is missing; and the guard that a layer reads its own window."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.attention.reference import AttentionMetadata, ReferenceAttention
from engine.models.gemma import activation, layer_types, rope_config
from engine.models.layers import rope_parameters
from engine.models.llama import layer_windows
from engine.models.loader import load_model
from engine.parallel.shard import Shard
from tests.models_fixtures import build_tiny_model

QWEN = {"num_hidden_layers": 4, "sliding_window": 8, "max_window_layers": 2}


@pytest.mark.parametrize(("arch", "config", "windows"), [
    ("MistralForCausalLM", {"num_hidden_layers": 2, "sliding_window": 8}, [8, 8]),
    ("MistralForCausalLM", {"num_hidden_layers": 2, "sliding_window": None}, [None, None]),
    ("Qwen2ForCausalLM", QWEN, [None] * 4),  # use_sliding_window defaults to false
    ("Qwen2ForCausalLM", {**QWEN, "use_sliding_window": True}, [None, None, 8, 8]),
    ("Qwen3ForCausalLM", {**QWEN, "use_sliding_window": True}, [None, None, 8, 8]),
    ("Qwen2MoeForCausalLM", {**QWEN, "use_sliding_window": True}, [8, None, None, None]),
    ("Qwen2ForCausalLM", {**QWEN, "use_sliding_window": True,
                          "layer_types": ["full_attention", "sliding_attention"] * 2},
     [None, 8, None, 8]),
])
def test_layer_windows_as_transformers_derives_them(arch, config, windows) -> None:
    assert layer_windows(arch, config) == windows


def test_gemma_legacy_keys() -> None:
    """Gemma 1's "gelu" means tanh-GELU; Gemma 3 without layer_types has one full layer in 6
    and rotates sliding layers with base 10000 when the config does not say."""
    assert activation("GemmaForCausalLM", {"hidden_act": "gelu"}) == "gelu_pytorch_tanh"
    assert activation("Gemma2ForCausalLM", {"hidden_act": "gelu"}) == "gelu_pytorch_tanh"
    assert activation("GemmaForCausalLM", {"hidden_act": "gelu_new"}) == "gelu_new"
    gemma3 = {"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 7,
              "sliding_window": 512, "rope_theta": 1e6}
    assert layer_types(gemma3) == ["sliding_attention"] * 5 + ["full_attention",
                                                               "sliding_attention"]
    assert rope_parameters(rope_config(gemma3, "sliding_attention"))["rope_theta"] == 10000.0
    assert rope_config(gemma3, "full_attention") is gemma3


def test_a_rank_without_collectives_holds_its_share_of_the_shared_expert(tmp_path) -> None:
    path = build_tiny_model(tmp_path, arch="qwen2_moe")
    model, _ = load_model(path, torch.float32, torch.device("cpu"), Shard(1, 2))
    moe = model.layers[0].moe
    assert moe.shared_gate_up.weight.shape == (48, 64)  # gate + up of 48 / 2 rows each
    assert moe.shared_down.weight.shape == (64, 24)


def test_a_layer_never_reads_another_windows_metadata() -> None:
    meta = AttentionMetadata(slot_mapping=torch.zeros(1, dtype=torch.long), page_size=4,
                             decode_token_idx=None, decode_pages=None, decode_mask=None,
                             prefills=(), backend=ReferenceAttention(), window=None)
    assert meta.for_layer(0, None) is meta
    with pytest.raises(AssertionError, match="window 8"):
        meta.for_layer(0, 8)
    windowed = replace(meta, window=8)
    grouped = replace(meta, groups=(meta, windowed), layer_groups=(1, 0))
    assert grouped.for_layer(0, 8) is windowed and grouped.for_layer(1, None) is meta
    with pytest.raises(AssertionError, match="layer 1"):
        grouped.for_layer(1, 8)
