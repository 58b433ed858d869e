"""A damaged file in the model folder stops start-up with the file's name and the reason:
config.json (read by the server before it binds, and by the engine), generation_config.json
and a safetensors checkpoint; not json's or safetensors' bare message."""

from __future__ import annotations

import argparse
import shutil

import pytest

from engine import EngineConfig, LLMEngine
from engine.model_files import ModelFileError, open_checkpoint, read_json_object
from handler.cli import resolve_config
from tests.models_fixtures import build_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("model-files-model"))


def damaged(model_dir, tmp_path, name: str, content: bytes):
    folder = tmp_path / "damaged"
    shutil.copytree(model_dir, folder)
    (folder / name).write_bytes(content)
    return folder


def load(folder) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(model=str(folder), batching="paged", device="cpu",
                                              dtype="float32", max_model_len=96))


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
def test_the_engine_names_a_json_file_that_is_not_json(model_dir, tmp_path, name) -> None:
    folder = damaged(model_dir, tmp_path, name, b'{"eos_token_id": ')
    with pytest.raises(ModelFileError, match=rf"^{name} is not valid JSON \(Expecting value.*"
                                             rf"\), in {folder}$"):
        load(folder)


def test_a_json_file_that_is_not_an_object_is_named(model_dir, tmp_path) -> None:
    folder = damaged(model_dir, tmp_path, "generation_config.json", b"[2]")
    with pytest.raises(ModelFileError, match="generation_config.json in .* must hold a JSON "
                                             "object, not a list"):
        load(folder)


def test_a_truncated_checkpoint_is_named(model_dir, tmp_path) -> None:
    whole = (model_dir / "model.safetensors").read_bytes()
    folder = damaged(model_dir, tmp_path, "model.safetensors", whole[:1000])
    with pytest.raises(ModelFileError, match=r"model.safetensors in .* is not a readable "
                                             r"safetensors file \(.*header"):
        load(folder)


def test_a_sound_folder_reads_as_before(model_dir) -> None:
    assert read_json_object(model_dir / "config.json")["architectures"] == ["LlamaForCausalLM"]
    with open_checkpoint(model_dir / "model.safetensors") as f:
        assert list(f.keys())


def test_the_server_names_config_json_before_it_binds(model_dir, tmp_path) -> None:
    """`batchyard serve` reads the architecture from config.json to pick the strategy; its
    configuration error (exit 2) names the file."""
    folder = damaged(model_dir, tmp_path, "config.json", b"\xff\xfe{")
    args = argparse.Namespace(properties=None, model_dir=folder)
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        resolve_config(args, {})
