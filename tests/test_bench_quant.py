"""`bench quant`: every variant reported, int4 smaller than float, and the W4A16 checkpoint it
writes decodes back to its float weights and serves through IntQuantLinear."""

from __future__ import annotations

import json
from argparse import Namespace

import torch

from benchmark import quant
from engine.quant.scheme import scheme_from_config
from engine.quant.unpack import decode
from tests.models_fixtures import build_tiny_model

FIGURES = ("linear_bytes", "weight_bytes", "ratio_to_float", "ratio_to_bf16",
           "decode_b1_tokens_per_s", "decode_b32_tokens_per_s", "requests_per_s")


def test_w4a16_tensors_dequantize_within_half_a_scale():
    weight = torch.randn(24, 256, generator=torch.Generator().manual_seed(0))
    weight[3, :64] = 0.0  # an all-zero group: scale 0, codes 8
    tensors = quant.quantize_w4a16(weight, 64)
    assert tensors["weight_packed"].dtype == torch.int32
    assert tensors["weight_packed"].shape == (24, 256 // 8)
    assert tensors["weight_scale"].shape == (24, 4)
    assert tensors["weight_shape"].tolist() == [24, 256]
    # by hand: element k at bits 4 (k % 8) of word k // 8, stored q + 8
    words = tensors["weight_packed"].to(torch.int64) & 0xFFFFFFFF
    shifts = 4 * torch.arange(8)
    q = ((words[..., None] >> shifts) & 15).flatten(1) - 8  # [N, K]
    scale = tensors["weight_scale"].repeat_interleave(64, dim=1)
    assert ((q * scale - weight).abs() <= scale / 2 * (1 + 1e-5) + 1e-7).all()
    assert q.min() >= -8 and q.max() <= 7
    # and the engine's compressed-tensors decoder reads the same values
    config = {"quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                      "weights": {"num_bits": 4, "type": "int",
                                                  "symmetric": True, "strategy": "group",
                                                  "group_size": 64}}}}}
    decoded = decode(scheme_from_config(config, None), tensors, "layer")
    engine_w = ((decoded.codes.float() - decoded.zeros.float().repeat_interleave(64, 1))
                * decoded.scales.float().repeat_interleave(64, 1))
    torch.testing.assert_close(engine_w, (q * scale).float())


def test_group_size_rule():
    assert quant.group_size({256, 512}) == 128
    assert quant.group_size({64, 128}) == 64
    assert quant.group_size({576, 1536}) == 64
    assert quant.group_size({96}) == 32


def test_bench_quant_reports_every_variant(tmp_path):
    model = build_tiny_model(tmp_path / "model")
    args = Namespace(model_dir=model, variants="float,int4,int8,fp8", clients=2, requests=2,
                     prompt_tokens=8, new_tokens=4, num_kv_blocks=None, device="cpu",
                     dtype="auto", out=tmp_path / "out")
    assert quant.run(args) == 0
    results = json.loads((tmp_path / "out" / "quant.json").read_text())
    assert (tmp_path / "out" / "quant.md").read_text().count("| int4 |") == 1
    runs = {row["variant"]: row for row in results["runs"]}
    assert set(runs) == {"float", "int4", "int8", "fp8"}
    for name, row in runs.items():
        if "error" in row:  # a variant this machine cannot run is reported, not raised
            assert name == "fp8", row
            continue
        assert all(row[key] > 0 for key in FIGURES), row
    assert runs["int4"]["linear_bytes"] < runs["float"]["linear_bytes"]
    assert runs["int4"]["layers"] == ["IntQuantLinear"]
    assert results["int4_group_size"] == 64  # K = 64 and 128


def test_written_int4_checkpoint_serves(tmp_path):
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.quant.linear import IntQuantLinear

    folder = quant.write_w4a16(build_tiny_model(tmp_path / "model"), tmp_path / "int4")
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization_config"]["config_groups"]["group_0"]["weights"][
        "group_size"] == 64
    engine = LLMEngine.from_config(EngineConfig(model=str(folder), batching="continuous",
                                                max_num_seqs=2, max_model_len=32,
                                                device="cpu"))
    try:
        layers = dict(engine.runner.model.named_modules())
        quantized = [name for name, m in layers.items() if isinstance(m, IntQuantLinear)]
        assert quantized and not any("lm_head" in name for name in quantized)
        assert all("layers." in name for name in quantized), quantized
        engine.add_request("a", [5, 6, 7, 8], SamplingParams(max_new_tokens=3))
        tokens = []
        while engine.has_unfinished():
            tokens += [e.token_id for e in engine.step() if e.token_id is not None]
        assert len(tokens) == 3
    finally:
        engine.close()
