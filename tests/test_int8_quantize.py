"""option.quantize=int8: weight-only int8 linears, close to the float layers, through every
strategy's engine; the first greedy tokens agree with float32 on a tiny model."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from engine.models.int8_linear import INT8_TOLERANCE, Int8Linear
from tests.engine_harness import Req, drive, greedy, make_engine
from tests.models_fixtures import build_tiny_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_is_close_to_the_float_layer(dtype) -> None:
    torch.manual_seed(0)
    weight, bias, x = torch.randn(96, 64), torch.randn(96), torch.randn(2, 5, 64)
    layer = Int8Linear(weight.to(dtype), bias.to(dtype))
    assert layer.qweight.dtype == torch.int8 and layer.qweight.shape == (96, 64)
    want = F.linear(x, weight, bias)
    got = layer(x.to(dtype)).float()
    assert got.shape == (2, 5, 96)
    assert ((got - want).abs().max() / want.abs().max()).item() < INT8_TOLERANCE
    layer.kernel = not layer.kernel  # the fused kernel and the dequantizing path agree
    other = layer(x.to(dtype)).float()
    assert torch.allclose(got, other, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("int8-model"))


@pytest.mark.parametrize("batching", ["none", "continuous", "paged"])
def test_engine_runs_int8_weights(model_dir, batching) -> None:
    prompt = [5, 17, 42, 7, 99, 3]
    runs = {}
    for quantize in (None, "int8"):
        engine = make_engine(model_dir, batching, quantize=quantize)
        linears = [m for m in engine.runner.model.modules() if isinstance(m, Int8Linear)]
        assert bool(linears) == (quantize == "int8")
        req = Req("r", prompt, greedy(8))
        drive(engine, [req])
        runs[quantize] = req.tokens
    assert len(runs["int8"]) == 8
    # Rounded weights may flip a later near-tie, not the first tokens of this model.
    assert runs["int8"][:2] == runs[None][:2]


def test_layers_without_the_fused_kernel_dequantize_and_say_so(model_dir, monkeypatch,
                                                               caplog) -> None:
    """Where PyTorch's fused int8 matmul is not built (it raises), every layer dequantizes, the
    start-up log counts them, and the engine still serves."""
    def unbuilt(*args):
        raise NotImplementedError("no kernel for this backend")
    monkeypatch.setattr(torch, "_weight_int8pack_mm", unbuilt)
    with caplog.at_level(logging.INFO, logger="engine.models.linear"):
        engine = make_engine(model_dir, "paged", quantize="int8")
    linears = [m for m in engine.runner.model.modules() if isinstance(m, Int8Linear)]
    assert linears and not any(m.kernel for m in linears)
    assert f"0 on PyTorch's fused int8 matmul, {len(linears)} dequantized" in caplog.text
    req = Req("r", [5, 17, 42, 7], greedy(4))
    drive(engine, [req])
    assert len(req.tokens) == 4
