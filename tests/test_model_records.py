"""Models as records (engine/models/registry.py): the native modules read an architecture's
features from its record, never its name, so an architecture that differs from the supported
ones only in features is served by registering one record; messages that list the native
architectures are built from the registry."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import NATIVE_ARCHITECTURES
from engine.models.loader import load_model
from engine.models.registry import ModelRecord, native_names, register, unregister
from tests.engine_harness import Req, drive, greedy, hf_greedy, make_engine
from tests.models_fixtures import build_tiny_model


@contextmanager
def registered(record: ModelRecord) -> Iterator[ModelRecord]:
    """`record` in the registry for the block, and gone after it whatever happens."""
    register(record)
    try:
        yield record
    finally:
        unregister(record.name)
    assert record.name not in NATIVE_ARCHITECTURES


def renamed(path: Path, arch: str) -> Path:
    """The model folder's config.json naming another architecture."""
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "architectures": [arch]}))
    return path


@pytest.mark.parametrize(("fixture", "features", "name"), [
    ("llama", "LlamaForCausalLM", "MyLlamaForCausalLM"),
    # q/k/v biases the config does not name: read from the record (Qwen2's feature)
    ("qwen2", "Qwen2ForCausalLM", "MyQwen2ForCausalLM"),
])
def test_an_architecture_that_differs_only_in_features_is_one_record(
        tmp_path, fixture, features, name) -> None:
    path = build_tiny_model(tmp_path, arch=fixture)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [[5, 9, 17, 33], list(range(3, 24))]
    refs = [hf_greedy(model, p, 8) for p in prompts]
    renamed(path, name)
    assert name not in NATIVE_ARCHITECTURES
    with registered(replace(NATIVE_ARCHITECTURES[features], name=name)):
        assert name in NATIVE_ARCHITECTURES and name in native_names()
        engine = make_engine(path, "paged")
        assert engine.runner.spec.architecture == name
        assert type(engine.runner.model).__name__ == "LlamaForCausalLM"
        reqs = [Req(f"r{i}", p, greedy(8)) for i, p in enumerate(prompts)]
        drive(engine, reqs)
    assert [r.tokens for r in reqs] == refs


def test_the_features_come_from_the_record_not_the_name(tmp_path) -> None:
    """A Qwen2 checkpoint under a record with Llama's features: its q/k/v biases have no place."""
    path = renamed(build_tiny_model(tmp_path, arch="qwen2"), "MyLlamaForCausalLM")
    with registered(replace(NATIVE_ARCHITECTURES["LlamaForCausalLM"], name="MyLlamaForCausalLM")):
        with pytest.raises(ValueError, match=r"unexpected weight .*_proj\.bias"):
            load_model(path, torch.float32, torch.device("cpu"), model_impl="native")


def test_messages_list_the_registry(tmp_path) -> None:
    path = build_tiny_model(tmp_path, arch="gpt_neox")
    with registered(ModelRecord("MyLlamaForCausalLM", "llama")):
        with pytest.raises(ValueError, match="native: .*MyLlamaForCausalLM"):
            load_model(path, torch.float32, torch.device("cpu"), model_impl="native")
    dense = native_names(dense_only=True).split(", ")
    assert "Gemma3ForCausalLM" in dense and "Phi3ForCausalLM" in dense
    assert "MixtralForCausalLM" not in dense
    assert sorted(NATIVE_ARCHITECTURES) == native_names().split(", ")


@pytest.mark.parametrize("features", [
    {"family": "llama", "soft_capping": True},  # only gemma.py caps
    {"family": "gemma", "moe": "mixtral"},  # only llama.py builds experts
    {"family": "llama", "windows": "alternating", "window_pattern": 2},
    {"family": "gemma", "windows": "alternating"},  # no pattern
    {"family": "llama", "activation_key": "hidden_activation"},
    {"family": "mamba"},
])
def test_a_record_its_implementation_would_not_honour_is_refused(features) -> None:
    with pytest.raises(ValueError, match="model record MyForCausalLM"):
        ModelRecord("MyForCausalLM", **features)


def test_the_registry_is_read_only_outside_register() -> None:
    with pytest.raises(TypeError):
        NATIVE_ARCHITECTURES["MyForCausalLM"] = ModelRecord(  # type: ignore[index]
            "MyForCausalLM", "llama")
    with pytest.raises(ValueError, match="already has a model record"):
        register(ModelRecord("LlamaForCausalLM", "llama"))
    assert NATIVE_ARCHITECTURES["LlamaForCausalLM"] == ModelRecord("LlamaForCausalLM", "llama")
