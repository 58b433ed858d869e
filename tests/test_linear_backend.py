"""oneDNN matmuls with packed weights: same tokens as aten, checked at start-up, selectable."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from engine.llm_engine import _pack_linears
from engine.models import linear
from engine.models.linear import PackedLinear, pack_linears, packed_checked, use_onednn
from tests.engine_harness import Req, drive, make_engine
from tests.models_fixtures import build_tiny_model

pytestmark = pytest.mark.skipif(
    not linear.onednn_supported(torch.device("cpu"), torch.float32), reason="no oneDNN")

CPU = torch.device("cpu")


def greedy_tokens(engine, prompts: list[list[int]]) -> list[list[int]]:
    from engine import SamplingParams

    params = SamplingParams(max_new_tokens=10, min_new_tokens=10, ignore_eos=True,
                            temperature=0)
    reqs = [Req(f"r{i}", p, params, i) for i, p in enumerate(prompts)]
    drive(engine, reqs)
    return [r.tokens for r in reqs]


@pytest.mark.parametrize("arch", ["llama", "llama_tied_llama3", "qwen2"])
def test_packed_engine_gives_the_aten_engines_tokens(tmp_path, arch) -> None:
    path = build_tiny_model(tmp_path, arch=arch)
    prompts = [[5, 9, 40, 7], list(range(3, 30)), [11] * 9]
    tokens = {}
    for backend in ("aten", "onednn"):
        engine = make_engine(path, "paged", block_size=4, max_num_seqs=3,
                             linear_backend=backend)
        model = engine.runner.model
        kinds = {type(m) for m in model.modules() if isinstance(m, nn.Linear | PackedLinear)}
        assert kinds == ({PackedLinear} if backend == "onednn" else {nn.Linear})
        assert (model.lm_head is None) == (backend == "aten" and arch == "llama_tied_llama3")
        tokens[backend] = greedy_tokens(engine, prompts)
    assert tokens["onednn"] == tokens["aten"]


def test_packed_linear_matches_f_linear_for_any_batch() -> None:
    layer = nn.Linear(24, 40)
    packed = PackedLinear(layer.weight, layer.bias, batch_hint=4)
    with torch.inference_mode():
        for rows in (1, 4, 37):
            x = torch.randn(rows, 24)
            torch.testing.assert_close(packed(x), layer(x), rtol=1e-5, atol=1e-5)
            strided = torch.randn(24, rows).t()  # a transposed view: not contiguous
            torch.testing.assert_close(packed(strided), layer(strided), rtol=1e-5, atol=1e-5)


def test_selection_and_its_errors() -> None:
    assert use_onednn("auto", CPU, torch.float32)
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()  # needs AVX-512 BW or AVX-NE-CONVERT
    assert use_onednn("auto", CPU, torch.bfloat16) == bf16
    assert not use_onednn("auto", torch.device("cuda"), torch.float32)  # CPU only
    assert not use_onednn("aten", CPU, torch.float32)
    assert not use_onednn("auto", CPU, torch.float16)  # no packed fp16 path: aten
    with pytest.raises(ValueError, match="linear_backend='onednn': needs a CPU with oneDNN"):
        use_onednn("onednn", CPU, torch.float16)
    with pytest.raises(ValueError, match="invalid linear_backend='mkl'"):
        use_onednn("mkl", CPU, torch.float32)


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no bf16 oneDNN")
def test_bf16_weights_pack_and_agree() -> None:
    layer = nn.Linear(64, 96).to(torch.bfloat16)
    packed = packed_checked(layer.weight, layer.bias, 8, "bf16 layer")
    with torch.inference_mode():
        x = torch.randn(5, 64).to(torch.bfloat16)
        torch.testing.assert_close(packed(x).float(), layer(x).float(), rtol=2e-2, atol=2e-2)


def test_a_kernel_that_fails_leaves_aten_matmuls(tmp_path, monkeypatch, caplog) -> None:
    """A oneDNN error (an unsupported CPU, say) under auto: aten, and the tied head untouched."""
    engine = make_engine(build_tiny_model(tmp_path, arch="llama_tied_llama3"), "paged",
                         linear_backend="aten")
    model = engine.runner.model

    def broken(*args, **kwargs):
        raise RuntimeError("mkldnn: unsupported on this CPU")

    monkeypatch.setattr(linear.PackedLinear, "__init__", broken)
    _pack_linears(model, replace(engine.config, linear_backend="auto"), CPU, torch.float32)
    assert "unsupported on this CPU; using aten matmuls" in caplog.text
    assert model.lm_head is None and all(type(m) is not PackedLinear for m in model.modules())
    with pytest.raises(ValueError, match="invalid linear_backend='onednn': mkldnn: unsupported"):
        _pack_linears(model, replace(engine.config, linear_backend="onednn"), CPU,
                      torch.float32)


def test_a_disagreeing_kernel_is_caught_at_start_up(tmp_path, monkeypatch, caplog) -> None:
    """auto keeps aten matmuls; onednn asked for by name stops start-up; nothing half-packed."""
    engine = make_engine(build_tiny_model(tmp_path), "paged", linear_backend="aten")
    model = engine.runner.model
    monkeypatch.setattr(linear, "TOLERANCE", {torch.float32: -1.0})  # any difference fails
    with pytest.raises(ValueError, match="differs from aten"):
        pack_linears(model)
    assert all(type(m) is not PackedLinear for m in model.modules())
    config = engine.config
    with pytest.raises(ValueError, match="invalid linear_backend='onednn'"):
        _pack_linears(model, replace(config, linear_backend="onednn"), CPU, torch.float32)
    _pack_linears(model, replace(config, linear_backend="auto"), CPU, torch.float32)
    assert "using aten matmuls" in caplog.text
    assert all(type(m) is not PackedLinear for m in model.modules())
