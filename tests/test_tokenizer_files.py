"""A tokenizer that cannot be loaded fails start-up with the file and the reason, not with the
JSON decoder's bare message, in the offline engine and behind a core process alike."""

from __future__ import annotations

import multiprocessing
import shutil

import pytest

from engine import EngineClient, EngineConfig, LLMEngine
from engine.text.tokenizer_files import TokenizerLoadError, load_tokenizer, tokenizer_problem
from tests.models_fixtures import build_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tokenizer-files-model"))


def copy_of(model_dir, tmp_path, name):
    folder = tmp_path / name
    shutil.copytree(model_dir, folder)
    return folder


def config(folder) -> EngineConfig:
    return EngineConfig(model=str(folder), batching="paged", device="cpu", dtype="float32",
                        max_model_len=96)


@pytest.mark.parametrize("broken", ["tokenizer.json", "tokenizer_config.json"])
def test_a_damaged_json_file_is_named(model_dir, tmp_path, broken) -> None:
    folder = copy_of(model_dir, tmp_path, "damaged")
    (folder / broken).write_text('{"truncated": ')
    with pytest.raises(TokenizerLoadError, match=rf"{broken} is not valid JSON \(Expecting value"):
        load_tokenizer(config(folder))


def test_a_file_that_is_not_text_is_named(model_dir, tmp_path) -> None:
    folder = copy_of(model_dir, tmp_path, "binary")
    (folder / "tokenizer.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(TokenizerLoadError, match=r"tokenizer.json is not valid JSON"):
        load_tokenizer(config(folder))


def test_a_folder_without_tokenizer_files_says_which_it_looked_for(model_dir, tmp_path) -> None:
    folder = copy_of(model_dir, tmp_path, "none")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    with pytest.raises(TokenizerLoadError, match=r"model .*none: the folder has none of "
                                                 r"tokenizer.json, tokenizer.model, vocab.json"):
        load_tokenizer(config(folder))


def test_other_failures_keep_transformers_reason_on_one_bounded_line(tmp_path) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    reason = tokenizer_problem(tmp_path, ValueError("first line\n" + "x" * 1000))
    assert reason.startswith("ValueError: first line xxx") and reason.endswith(" …")
    assert "\n" not in reason and len(reason) < 340


def test_a_sound_tokenizer_loads(model_dir) -> None:
    assert load_tokenizer(config(model_dir)).encode("hello")


def test_the_offline_engine_fails_with_the_named_file(model_dir, tmp_path) -> None:
    folder = copy_of(model_dir, tmp_path, "offline")
    (folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerLoadError, match="tokenizer.json is not valid JSON"):
        LLMEngine.from_config(config(folder))


def test_a_served_start_up_fails_with_the_named_file_and_leaves_no_core(model_dir,
                                                                       tmp_path) -> None:
    """The serving process loads the tokenizer while the core process loads the model: its
    error stops the core and is the one start-up reports."""
    folder = copy_of(model_dir, tmp_path, "served")
    (folder / "tokenizer_config.json").write_text("[")
    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(TokenizerLoadError, match="tokenizer_config.json is not valid JSON"):
        EngineClient.from_config(config(folder), max_queued=1, process=True)
    assert {p.pid for p in multiprocessing.active_children()} <= before
