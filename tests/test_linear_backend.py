"""Packed CPU matmuls (the tiled C kernel, oneDNN): same tokens as aten, checked at start-up,
selectable, and `auto` falls back from one to the next."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from engine.kernels import build_kernels
from engine.models import linear
from engine.models.linear import (
    PackedLinear,
    TiledLinear,
    linear_candidates,
    linear_factory,
    pack_linears,
    pack_model_linears,
    packed_checked,
)
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
    kind = {"aten": nn.Linear, "onednn": PackedLinear, "tiled": TiledLinear}
    for backend in ("aten", "onednn", "tiled"):
        engine = make_engine(path, "paged", block_size=4, max_num_seqs=3,
                             linear_backend=backend)
        model = engine.runner.model
        kinds = {type(m) for m in model.modules() if isinstance(m, tuple(kind.values()))}
        assert kinds == {kind[backend]}
        assert (model.lm_head is None) == (backend == "aten" and arch == "llama_tied_llama3")
        tokens[backend] = greedy_tokens(engine, prompts)
    assert tokens["onednn"] == tokens["aten"] == tokens["tiled"]


def test_packed_linear_matches_f_linear_for_any_batch() -> None:
    layer = nn.Linear(24, 40)
    packed = PackedLinear(layer.weight, layer.bias, batch_hint=4)
    with torch.inference_mode():
        for rows in (1, 4, 37):
            x = torch.randn(rows, 24)
            torch.testing.assert_close(packed(x), layer(x), rtol=1e-5, atol=1e-5)
            strided = torch.randn(24, rows).t()  # a transposed view: not contiguous
            torch.testing.assert_close(packed(strided), layer(strided), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [0, 1, 4, 6, 7, 13, 25, 37])
def test_tiled_linear_matches_f_linear_for_any_batch(rows) -> None:
    """Rows in passes of up to 6 (AVX2: 7 = 4 + 3, 25 = 5 x 5) or 8 (AVX-512: 13 = 7 + 6,
    37 = 5 passes), a last tile of 8 of 16 columns, alone in its block of two on AVX-512."""
    layer = nn.Linear(24, 40)
    tiled = TiledLinear(layer.weight, layer.bias)
    plain = TiledLinear(layer.weight, None)
    with torch.inference_mode():
        x = torch.randn(rows, 24)
        torch.testing.assert_close(tiled(x), layer(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(plain(x), x @ layer.weight.t(), rtol=1e-5, atol=1e-5)
        strided = torch.randn(24, rows).t()  # a transposed view: not contiguous
        torch.testing.assert_close(tiled(strided), layer(strided), rtol=1e-5, atol=1e-5)
        batched = torch.randn(2, 3, 24)  # any leading shape, as nn.Linear
        torch.testing.assert_close(tiled(batched), layer(batched), rtol=1e-5, atol=1e-5)
        with pytest.raises(TypeError, match="computes float32"):
            tiled(x.double())


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512",
                    reason="needs AVX-512")
def test_tiled_linear_gives_the_same_bits_with_avx512_and_avx2() -> None:
    """Blocks of two tiles in 16-float vectors, or one tile in 8-float vectors: each output is
    the same sum over k in the same order, so the two builds must agree bit for bit."""
    layer = nn.Linear(200, 72)  # 5 tiles: two blocks of two and one tile alone
    tiled = TiledLinear(layer.weight, layer.bias)
    avx2 = TiledLinear(layer.weight, layer.bias)
    avx2.lib = build_kernels(("-mno-avx512f",))
    with torch.inference_mode():
        for rows in (1, 5, 8, 13, 28):
            x = torch.randn(rows, 200)
            assert torch.equal(tiled(x), avx2(x)), rows


def test_selection_and_its_errors() -> None:
    assert linear_candidates("auto", CPU, torch.float32) == ["tiled", "onednn"]
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()  # needs AVX-512 BW or AVX-NE-CONVERT
    assert linear_candidates("auto", CPU, torch.bfloat16) == (["onednn"] if bf16 else [])
    assert linear_candidates("auto", torch.device("cuda"), torch.float32) == []  # CPU only
    assert linear_candidates("aten", CPU, torch.float32) == []
    assert linear_candidates("onednn", CPU, torch.float32) == ["onednn"]
    assert linear_candidates("tiled", CPU, torch.float32) == ["tiled"]
    assert linear_candidates("auto", CPU, torch.float16) == []  # no packed fp16 path: aten
    with pytest.raises(ValueError, match="linear_backend='onednn': needs a CPU with oneDNN"):
        linear_candidates("onednn", CPU, torch.float16)
    with pytest.raises(ValueError, match="linear_backend='tiled': needs a CPU and float32"):
        linear_candidates("tiled", CPU, torch.bfloat16)
    with pytest.raises(ValueError, match="invalid linear_backend='mkl'"):
        linear_candidates("mkl", CPU, torch.float32)


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no bf16 oneDNN")
def test_bf16_weights_pack_and_agree() -> None:
    layer = nn.Linear(64, 96).to(torch.bfloat16)
    packed = packed_checked(linear_factory("onednn", 8), layer.weight, layer.bias, "bf16")
    with torch.inference_mode():
        x = torch.randn(5, 64).to(torch.bfloat16)
        torch.testing.assert_close(packed(x).float(), layer(x).float(), rtol=2e-2, atol=2e-2)


def broken(message: str):
    def init(*args, **kwargs):
        raise RuntimeError(message)
    return init


def test_a_tiled_kernel_that_fails_falls_back_to_onednn(tmp_path, monkeypatch, caplog) -> None:
    """No C compiler, say: auto packs with oneDNN; tiled asked for by name stops start-up."""
    engine = make_engine(build_tiny_model(tmp_path, arch="llama_tied_llama3"), "paged",
                         linear_backend="aten")
    model = engine.runner.model
    monkeypatch.setattr(linear.TiledLinear, "__init__", broken("no C compiler"))
    with pytest.raises(ValueError, match="invalid linear_backend='tiled': no C compiler"):
        pack_model_linears(model, replace(engine.config, linear_backend="tiled"), CPU,
                           torch.float32)
    assert model.lm_head is None  # nothing half-packed
    pack_model_linears(model, replace(engine.config, linear_backend="auto"), CPU, torch.float32)
    assert "tiled failed (no C compiler); trying the next" in caplog.text
    assert type(model.lm_head) is PackedLinear


def test_kernels_that_fail_leave_aten_matmuls(tmp_path, monkeypatch, caplog) -> None:
    """Both packed backends fail under auto: aten, and the tied head untouched."""
    engine = make_engine(build_tiny_model(tmp_path, arch="llama_tied_llama3"), "paged",
                         linear_backend="aten")
    model = engine.runner.model
    monkeypatch.setattr(linear.TiledLinear, "__init__", broken("no C compiler"))
    monkeypatch.setattr(linear.PackedLinear, "__init__", broken("mkldnn: unsupported"))
    pack_model_linears(model, replace(engine.config, linear_backend="auto"), CPU, torch.float32)
    assert "no packed backend agreed; using aten matmuls" in caplog.text
    assert model.lm_head is None and all(type(m) is nn.Linear for m in model.modules()
                                         if isinstance(m, nn.Linear | PackedLinear | TiledLinear))
    with pytest.raises(ValueError, match="invalid linear_backend='onednn': mkldnn: unsupported"):
        pack_model_linears(model, replace(engine.config, linear_backend="onednn"), CPU,
                      torch.float32)


def test_a_disagreeing_kernel_is_caught_at_start_up(tmp_path, monkeypatch, caplog) -> None:
    """auto keeps aten matmuls; a backend asked for by name stops start-up; nothing half-packed."""
    engine = make_engine(build_tiny_model(tmp_path), "paged", linear_backend="aten")
    model = engine.runner.model
    monkeypatch.setattr(linear, "TOLERANCE", {torch.float32: -1.0})  # any difference fails
    for backend in ("onednn", "tiled"):
        with pytest.raises(ValueError, match="packed linear .* differs from aten"):
            pack_linears(model, backend)
        assert all(type(m) is nn.Linear for m in model.modules()
                   if isinstance(m, nn.Linear | PackedLinear | TiledLinear))
        with pytest.raises(ValueError, match=f"invalid linear_backend='{backend}'"):
            pack_model_linears(model, replace(engine.config, linear_backend=backend), CPU,
                          torch.float32)
    pack_model_linears(model, replace(engine.config, linear_backend="auto"), CPU, torch.float32)
    assert "using aten matmuls" in caplog.text
    assert all(type(m) is nn.Linear for m in model.modules()
               if isinstance(m, nn.Linear | PackedLinear | TiledLinear))
