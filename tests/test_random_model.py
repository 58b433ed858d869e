"""`batchyard bench random-model`: a random-weight Llama folder that the engine serves."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from benchmark.cli import main as bench_main
from benchmark.random_model import PRESETS, build_random_llama
from tests.engine_harness import Req, drive, greedy, make_engine
from tests.models_fixtures import VOCAB_SIZE, build_tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return path


def test_tiny_preset_is_served_by_every_strategy(tokenizer_dir, tmp_path, capsys) -> None:
    out = tmp_path / "random"
    assert bench_main(["random-model", str(out), "--preset", "llama-tiny", "--tokenizer-from",
                       str(tokenizer_dir), "--dtype", "float32"]) == 0
    assert "llama-tiny" in capsys.readouterr().out
    config = AutoConfig.from_pretrained(out)
    assert config.model_type == "llama" and config.vocab_size == VOCAB_SIZE
    assert config.hidden_size == PRESETS["llama-tiny"]["hidden_size"]
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    for batching in ("none", "paged"):
        reqs = [Req("a", [1, 5, 9, 30], greedy(6)), Req("b", [1, 7], greedy(3))]
        drive(make_engine(out, batching), reqs)
        assert [len(r.tokens) for r in reqs] == [6, 3]


def test_parameter_count_and_refusals(tokenizer_dir, tmp_path) -> None:
    preset = PRESETS["llama-tiny"]
    h, i, n = preset["hidden_size"], preset["intermediate_size"], preset["num_hidden_layers"]
    kv = h // preset["num_attention_heads"] * preset["num_key_value_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    want = n * per_layer + 2 * VOCAB_SIZE * h + h  # untied embedding and head, final norm
    assert build_random_llama(tmp_path / "m", tokenizer_dir, "llama-tiny", "float32") == want
    with pytest.raises(ValueError, match="not empty"):
        build_random_llama(tmp_path / "m", tokenizer_dir, "llama-tiny", "float32")
    with pytest.raises(ValueError, match="preset"):
        build_random_llama(tmp_path / "x", tokenizer_dir, "llama-70b")
    with pytest.raises(ValueError, match="dtype"):
        build_random_llama(tmp_path / "y", tokenizer_dir, "llama-tiny", "int4")
