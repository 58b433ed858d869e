"""Pre-quantized checkpoints served as published: for each format (built in tests/quant_fixtures.py
from its definition), greedy float32 output equals transformers `generate` on the same weights
dequantized (with the checkpoint's FP8 activation rounding), in every strategy and under tensor
parallelism 2; the layers stay quantized in memory; bad checkpoints are refused by name."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

from engine.models.loader import load_model
from engine.parallel.shard import Shard
from engine.quant import linear as quant_linear
from engine.quant.linear import Fp8Linear, IntQuantLinear
from tests.ct_fixtures import ct_reference_greedy, write_ct_checkpoint
from tests.engine_harness import drive, hf_greedy, make_engine, staggered_requests
from tests.models_fixtures import build_tiny_model
from tests.quant_fixtures import activation_fake_quant, dequantized_folder, quantize_folder

# name → quantize_folder arguments (tiny model: K 64 / 128, groups of 32, fp8 blocks 32 x 32)
FORMATS = {
    "awq": {"fmt": "awq"},
    "gptq": {"fmt": "gptq"},
    "gptq-v2-asym-act-order": {"fmt": "gptq", "checkpoint_format": "gptq_v2", "sym": False,
                               "desc_act": True},
    "gptq-3bit": {"fmt": "gptq", "bits": 3},
    "gptq-8bit-per-channel": {"fmt": "gptq", "bits": 8, "group_size": -1},
    "ct-int4": {"fmt": "ct-int"},
    "ct-int4-asym-act-order": {"fmt": "ct-int", "sym": False, "desc_act": True},
    "ct-int8": {"fmt": "ct-int", "bits": 8},
    "fp8-block": {"fmt": "fp8"},
    "fp8-static": {"fmt": "fp8", "block": None, "activations": "static"},
    "fp8-tensor-dynamic": {"fmt": "fp8", "block": None},
    "ct-fp8-channel": {"fmt": "ct-fp8"},
    "ct-fp8-static": {"fmt": "ct-fp8", "strategy": "tensor", "activations": "static"},
    "ct-fp8-block": {"fmt": "ct-fp8", "strategy": "block"},
}
# one of each published family: every strategy
MAIN = ("awq", "gptq-v2-asym-act-order", "ct-int4", "fp8-block", "ct-fp8-static")
PROMPTS = ([5, 17, 42, 7, 99, 3], [11, 2, 250, 31, 64, 8, 19, 77, 5, 140, 6], [200, 4, 9])
NEW_TOKENS = (8, 6, 7)
ARRIVALS = (0, 1, 3)


class Checkpoints:
    """Quantized folders and their transformers references, made once per module."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.src = build_tiny_model(root / "float")
        self.made: dict[str, tuple[Path, list[list[int]]]] = {}

    def folder(self, name: str, **extra) -> Path:
        return self.get(name, **extra)[0]

    def get(self, name: str, **extra) -> tuple[Path, list[list[int]]]:
        if name not in self.made:
            args = {**FORMATS.get(name, {}), **extra}
            folder = quantize_folder(self.src, self.root / name, args.pop("fmt"), **args)
            reference = AutoModelForCausalLM.from_pretrained(
                dequantized_folder(folder, self.root / f"{name}-reference"),
                dtype=torch.float32)
            activation_fake_quant(reference, folder)
            want = [hf_greedy(reference, p, n) for p, n in zip(PROMPTS, NEW_TOKENS, strict=True)]
            self.made[name] = (folder, want)
        return self.made[name]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("quantized"))


def served(folder: Path, batching: str, **overrides) -> list[list[int]]:
    engine = make_engine(folder, batching, **overrides)
    try:
        reqs = staggered_requests(PROMPTS, NEW_TOKENS, ARRIVALS)
        drive(engine, reqs)
    finally:
        engine.close()
    return [r.tokens for r in reqs]


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_format_serves_what_transformers_generates_on_its_weights(checkpoints,
                                                                       name) -> None:
    folder, want = checkpoints.get(name)
    assert served(folder, "paged") == want


@pytest.mark.parametrize("batching", ["none", "dynamic", "continuous"])
@pytest.mark.parametrize("name", MAIN)
def test_every_strategy_serves_each_family_exactly(checkpoints, name, batching) -> None:
    folder, want = checkpoints.get(name)
    assert served(folder, batching) == want


@pytest.mark.parametrize("name", ["awq", "gptq-v2-asym-act-order", "fp8-block"])
def test_tensor_parallel_shards_packed_weights_on_group_boundaries(checkpoints, name) -> None:
    folder, want = checkpoints.get(name)
    assert served(folder, "paged", tensor_parallel_size=2) == want


def test_layers_stay_quantized_in_memory(checkpoints) -> None:
    """int4 codes two to a byte with float16 scales: at most 0.3x the bf16 weight bytes."""
    model, _ = load_model(checkpoints.folder("gptq"), torch.float32, torch.device("cpu"))
    layers = [m for m in model.modules() if isinstance(m, IntQuantLinear)]
    assert len(layers) == 2 * 4  # qkv, o, gate_up, down in each of 2 layers
    assert type(model.lm_head) is nn.Linear  # the ignore list keeps it in full precision
    held = sum(b.numel() * b.element_size() for m in layers for b in m.buffers())
    bf16 = sum(m.out_features * m.in_features * 2 for m in layers)
    assert held <= 0.3 * bf16
    qkv = model.layers[0].qkv_proj
    assert qkv.codes.dtype == torch.uint8
    assert qkv.codes.shape == (qkv.out_features, qkv.in_features // 2)


def test_an_ignored_layer_loads_in_full_precision(checkpoints) -> None:
    name = "ct-int4-ignore"
    folder, want = checkpoints.get(name, fmt="ct-int",
                                   ignore=("lm_head", "re:.*layers\\.1\\.mlp\\.down_proj"))
    model, _ = load_model(folder, torch.float32, torch.device("cpu"))
    assert type(model.layers[1].down_proj) is nn.Linear
    assert isinstance(model.layers[0].down_proj, IntQuantLinear)
    assert served(folder, "continuous") == want


def test_quantize_fp8_at_load_equals_an_fp8_checkpoint_of_the_same_weights(checkpoints,
                                                                          caplog) -> None:
    """option.quantize=fp8 on float weights: per-channel weight scales and per-token
    activations, lm_head kept float: the arithmetic of a compressed-tensors FP8_DYNAMIC
    checkpoint made from the same weights."""
    _, want = checkpoints.get("ct-fp8-channel")
    with caplog.at_level(logging.INFO, logger="engine.models.linear"):
        engine = make_engine(checkpoints.src, "paged", quantize="fp8")
    model = engine.runner.model
    assert isinstance(model.layers[0].qkv_proj, Fp8Linear)
    assert not isinstance(model.lm_head, Fp8Linear)
    assert any("quantized to fp8" in r.message for r in caplog.records)
    reqs = staggered_requests(PROMPTS, NEW_TOKENS, ARRIVALS)
    drive(engine, reqs)
    engine.close()
    assert [r.tokens for r in reqs] == want


def test_fast_paths_checked_at_start_up_serve_the_same_tokens(checkpoints, monkeypatch) -> None:
    """The GPU paths run on the CPU here (Triton's interpreter, PyTorch's CPU _scaled_mm): each
    passes its start-up check and serves the emulated path's tokens."""
    monkeypatch.setattr(quant_linear, "KERNEL_DEVICES", ("cuda", "cpu"))
    for name in ("ct-int4", "ct-fp8-static"):
        folder, want = checkpoints.get(name)
        engine = make_engine(folder, "continuous")
        model = engine.runner.model
        layer = model.layers[0].qkv_proj
        assert layer.kernel if name == "ct-int4" else layer.scaled_mm
        reqs = staggered_requests(PROMPTS[:1], NEW_TOKENS[:1], ARRIVALS[:1])
        drive(engine, reqs)
        engine.close()
        assert reqs[0].tokens == want[0]


def test_a_kernel_that_disagrees_at_start_up_is_left_off_loudly(checkpoints, monkeypatch,
                                                                caplog) -> None:
    from engine.kernels import triton_wq

    monkeypatch.setattr(quant_linear, "KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(quant_linear, "_warned", set())
    wrong = triton_wq.wq_matmul
    monkeypatch.setattr(triton_wq, "wq_matmul", lambda *a, **k: wrong(*a, **k) + 1.0)
    with caplog.at_level(logging.WARNING, logger="engine.quant.linear"):
        model, _ = load_model(checkpoints.folder("ct-int4"), torch.float32, torch.device("cpu"))
    assert not model.layers[0].qkv_proj.kernel
    assert any("dequantizing instead" in r.message for r in caplog.records)


# -- refusals: at start-up, naming the tensor or the field -------------------------------------

def edited_copy(src: Path, dst: Path, config=None, tensors=None) -> Path:
    """A copy of `src` with config.json's quantization_config and the tensors edited."""
    shutil.copytree(src, dst)
    if config is not None:
        path = dst / "config.json"
        data = json.loads(path.read_text())
        config(data["quantization_config"])
        path.write_text(json.dumps(data))
    if tensors is not None:
        weights = load_file(dst / "model.safetensors")
        tensors(weights)
        save_file({k: v.contiguous() for k, v in weights.items()}, dst / "model.safetensors")
    return dst


def load(folder: Path, shard: Shard | None = None, quantize: str | None = None):
    return load_model(folder, torch.float32, torch.device("cpu"), shard, quantize=quantize)


Q = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize(("name", "config", "tensors", "message"), [
    ("gptq", None, lambda t: t.pop(f"{Q}.scales"), f"lacks {Q}.scales"),
    ("awq", None, lambda t: t.pop(f"{Q}.qzeros"), f"lacks {Q}.qzeros"),
    ("ct-fp8-static", None, lambda t: t.pop(f"{Q}.input_scale"), f"lacks {Q}.input_scale"),
    ("fp8-block", None, lambda t: t.pop(f"{Q}.weight_scale_inv"), "weight_scale_inv"),
    ("gptq", None, lambda t: t.update({f"{Q}.qweight": t[f"{Q}.qweight"][:-1]}),
     f"{Q}.qweight has 7 rows"),
    ("awq", None, lambda t: t.update({f"{Q}.qweight": t[f"{Q}.qweight"][:, :-1]}),
     f"{Q}.qzeros has shape"),
    ("ct-int4", None, lambda t: t.update({f"{Q}.weight_packed": t[f"{Q}.weight_packed"].float()}),
     f"{Q}.weight_packed is torch.float32"),
    ("gptq", lambda c: c.update(group_size=48), None, "group_size=48 does not divide"),
    ("gptq", lambda c: c.update(quant_method="bitsandbytes"), None, "quant_method='bitsandbytes'"),
    ("gptq", lambda c: c.update(bits=5), None, "quantization_config.bits=5"),
    ("awq", lambda c: c.update(version="gemv"), None, "quantization_config.version='gemv'"),
    ("ct-int4", lambda c: c.update(format="marlin-24"), None, "format='marlin-24'"),
    ("ct-fp8-channel", lambda c: c.update(kv_cache_scheme={"num_bits": 8}), None,
     "kv_cache_scheme"),
    ("awq", None, lambda t: t.update({f"{Q}.qweight": t[f"{Q}.qweight"][0]}),
     f"{Q}.qweight has 1 dimensions"),
    ("gptq", None, lambda t: t.update({f"{Q}.bias": torch.ones(64)}), f"{Q}.bias is not zero"),
])
def test_bad_checkpoints_are_refused_by_name(checkpoints, tmp_path, name, config, tensors,
                                             message) -> None:
    folder = edited_copy(checkpoints.folder(name), tmp_path / "bad", config, tensors)
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")
                       .replace("[", r"\[")):
        load(folder)


def test_a_fused_layer_half_quantized_is_refused(checkpoints, tmp_path) -> None:
    k = "model.layers.0.self_attn.k_proj"

    def float_k(t: dict) -> None:
        for suffix in ("qweight", "qzeros", "scales", "g_idx"):
            t.pop(f"{k}.{suffix}", None)
        t[f"{k}.weight"] = torch.zeros(64, 64)

    folder = edited_copy(checkpoints.folder("gptq"), tmp_path / "half", None, float_k)
    with pytest.raises(ValueError, match=f"{k}.weight is stored in full precision"):
        load(folder)


def test_option_quantize_must_match_the_checkpoint(checkpoints) -> None:
    with pytest.raises(ValueError, match="option.quantize='awq'.*quant_method='gptq'"):
        load(checkpoints.folder("gptq"), quantize="awq")
    load(checkpoints.folder("gptq"), quantize="gptq")  # the same format: served
    with pytest.raises(ValueError, match="quantize='awq'.*no quantization_config"):
        load(checkpoints.src, quantize="awq")


def test_a_tensor_parallel_degree_that_splits_a_group_is_refused(tmp_path) -> None:
    """down_proj's 96 input columns split in two are 48 per rank: groups of 32 would be cut."""
    src = build_tiny_model(tmp_path / "float", intermediate_size=96)
    folder = quantize_folder(src, tmp_path / "gptq", "gptq", group_size=32)
    load(folder)  # whole: served
    with pytest.raises(ValueError, match="down_proj.*cut quantization groups of 32"):
        load(folder, Shard(1, 2))


@pytest.mark.parametrize("batching", ["none", "paged"])
@pytest.mark.parametrize("scheme", ["W4A16", "FP8_DYNAMIC"])
def test_compressed_tensors_checkpoints_serve_as_transformers_loads_them(checkpoints, scheme,
                                                                         batching) -> None:
    """Written by compressed-tensors (what llm-compressor writes with); the reference is
    transformers loading the same folder through its own compressed-tensors support."""
    name = f"library-{scheme}"
    if name not in checkpoints.made:
        folder = write_ct_checkpoint(checkpoints.src, checkpoints.root / name, scheme)
        checkpoints.made[name] = (folder, [ct_reference_greedy(folder, p, n) for p, n
                                           in zip(PROMPTS, NEW_TOKENS, strict=True)])
    folder, want = checkpoints.made[name]
    assert served(folder, batching) == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["ct-int4", "ct-fp8-channel"])
def test_cuda_fast_paths_pass_their_check_and_serve_the_emulated_tokens(checkpoints,
                                                                        name) -> None:
    """On a GPU in bfloat16: the Triton int GEMM / torch._scaled_mm are chosen (they passed the
    start-up check) and serve what the emulated path serves with graphs on."""
    folder, _ = checkpoints.get(name)
    runs = {}
    for devices in (("cuda",), ()):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(quant_linear, "KERNEL_DEVICES", devices)
            engine = make_engine(folder, "paged", device="cuda", dtype="bfloat16")
            layer = engine.runner.model.layers[0].qkv_proj
            assert (layer.kernel if name == "ct-int4" else layer.scaled_mm) == bool(devices)
            reqs = staggered_requests(PROMPTS, NEW_TOKENS, ARRIVALS)
            drive(engine, reqs)
            engine.close()
        runs[devices] = [r.tokens for r in reqs]
    # bf16 rounding may flip a late near-tie; the first tokens of each request agree
    assert [t[:3] for t in runs[("cuda",)]] == [t[:3] for t in runs[()]]


def test_zero_biases_of_older_gptq_tools_are_passed_over(checkpoints, tmp_path) -> None:
    def zero_biases(t: dict) -> None:
        for name in [n for n in t if n.endswith(".qweight")]:
            t[name.replace(".qweight", ".bias")] = torch.zeros(t[name].shape[1],
                                                              dtype=torch.float16)

    folder = edited_copy(checkpoints.folder("gptq"), tmp_path / "biased", None, zero_biases)
    model, _ = load(folder)
    assert model.layers[0].qkv_proj.bias is None


def test_autoawq_quant_config_json_is_read_where_config_json_has_none(checkpoints,
                                                                    tmp_path) -> None:
    folder = tmp_path / "legacy"
    shutil.copytree(checkpoints.folder("awq"), folder)
    config = json.loads((folder / "config.json").read_text())
    quant = config.pop("quantization_config")
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "quant_config.json").write_text(json.dumps(
        {"zero_point": True, "q_group_size": quant["group_size"], "w_bit": 4, "version": "GEMM"}))
    model, _ = load(folder)
    assert isinstance(model.layers[0].qkv_proj, IntQuantLinear)


@pytest.mark.parametrize("name", ["gptq-8bit-per-channel", "ct-int8-channel"])
def test_per_channel_scales_split_at_any_column(checkpoints, name) -> None:
    """One scale per row: the row-parallel layers' input columns cut anywhere."""
    extra = {"fmt": "ct-int", "bits": 8, "strategy": "channel"} if name.endswith("channel") else {}
    folder = checkpoints.folder(name, **extra)
    whole, _ = load(folder)
    want = whole.layers[0].down_proj.dequantized(torch.float32)
    halves = [load(folder, Shard(rank, 2))[0].layers[0].down_proj.dequantized(torch.float32)
              for rank in range(2)]
    assert torch.equal(torch.cat(halves, dim=1), want)


def test_a_kernel_giving_nan_at_start_up_is_left_off(checkpoints, monkeypatch) -> None:
    from engine.kernels import triton_wq

    monkeypatch.setattr(quant_linear, "KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(triton_wq, "wq_matmul", lambda x, *a, **k: torch.full(
        (x.shape[0], a[0].shape[0]), float("nan")))
    model, _ = load(checkpoints.folder("ct-int4"))
    assert not model.layers[0].qkv_proj.kernel


def test_lora_adapters_run_over_quantized_layers(checkpoints) -> None:
    """A PEFT adapter over a GPTQ checkpoint serves what PEFT gives on its dequantized
    weights."""
    from dataclasses import replace

    from tests.engine_harness import Req, greedy
    from tests.test_lora import make_adapter

    folder, _ = checkpoints.get("gptq")
    peft = make_adapter(checkpoints.root / "gptq-reference", checkpoints.root / "gptq-lora", 1)
    want = [hf_greedy(peft, p, n) for p, n in zip(PROMPTS, NEW_TOKENS, strict=True)]
    engine = make_engine(folder, "paged", enable_lora=True,
                         lora_modules=(("ad", str(checkpoints.root / "gptq-lora")),))
    reqs = [Req(f"r{i}", p, replace(greedy(n), adapter="ad"))
            for i, (p, n) in enumerate(zip(PROMPTS, NEW_TOKENS, strict=True))]
    drive(engine, reqs)
    engine.close()
    assert [r.tokens for r in reqs] == want
