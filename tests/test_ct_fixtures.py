"""The compressed-tensors fixtures: checkpoints in llm-compressor's formats, read back by
transformers."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from tests.ct_fixtures import FORMATS, ct_reference_greedy, write_ct_checkpoint
from tests.models_fixtures import build_tiny_model

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("ct_src"))


def _tensors(folder) -> dict:
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("scheme", ["W4A16", "FP8_DYNAMIC"])
def test_ct_checkpoint(tiny, tmp_path, scheme):
    import torch

    folder = write_ct_checkpoint(tiny, tmp_path / scheme, scheme)
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["format"] == FORMATS[scheme]
    assert qc["quantization_status"] == "compressed"
    assert qc["ignore"] == ["lm_head"]
    (group,) = qc["config_groups"].values()
    assert group["targets"] == ["Linear"] and group["format"] == FORMATS[scheme]
    weights, acts = group["weights"], group["input_activations"]
    assert (folder / "tokenizer.json").exists()

    tensors = _tensors(folder)
    assert tensors["lm_head.weight"].dtype == torch.float32  # ignored: stays dense
    for layer in range(2):
        for linear in LINEARS:
            prefix = f"model.layers.{layer}.{linear}."
            names = {k[len(prefix):] for k in tensors if k.startswith(prefix)}
            if scheme == "W4A16":
                assert (weights["num_bits"], weights["type"], weights["strategy"],
                        weights["group_size"], weights["symmetric"]) == (4, "int", "group", 32,
                                                                         True)
                assert acts is None
                assert names == {"weight_packed", "weight_scale", "weight_shape"}
                n, k = tensors[prefix + "weight_shape"].tolist()
                assert tensors[prefix + "weight_packed"].dtype == torch.int32
                assert tensors[prefix + "weight_packed"].shape == (n, k // 8)
                assert tensors[prefix + "weight_scale"].shape == (n, k // 32)
            else:
                assert (weights["num_bits"], weights["type"], weights["strategy"]) == (
                    8, "float", "channel")
                assert (acts["num_bits"], acts["type"], acts["strategy"], acts["dynamic"]) == (
                    8, "float", "token", True)
                assert names == {"weight", "weight_scale"}
                n, _ = tensors[prefix + "weight"].shape
                assert tensors[prefix + "weight"].dtype == torch.float8_e4m3fn
                assert tensors[prefix + "weight_scale"].shape == (n, 1)

    out = ct_reference_greedy(folder, [1, 5, 9, 20], 6)
    assert len(out) == 6 and all(isinstance(t, int) for t in out)
