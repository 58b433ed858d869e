"""Model folder resolution: safetensors only, no traversal out of the model directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from handler.model_source.checks import check_model_dir
from handler.model_source.store import resolve_model_dir


def fake_model(path: Path, weights: str = "model.safetensors") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    (path / weights).write_bytes(b"x")
    return path


def test_explicit_model_dir_wins(tmp_path) -> None:
    model = fake_model(tmp_path / "m")
    assert resolve_model_dir(model, "/elsewhere", None, root=tmp_path / "root") == model


def test_relative_model_id_is_resolved_under_the_model_dir(tmp_path) -> None:
    fake_model(tmp_path / "root" / "llama")
    got = resolve_model_dir(None, "llama", None, root=tmp_path / "root")
    assert got == (tmp_path / "root" / "llama").resolve()


@pytest.mark.parametrize("model_id", ["../secret", "llama/../../secret", "link"])
def test_model_id_cannot_escape_the_model_dir(tmp_path, model_id) -> None:
    root = tmp_path / "root"
    root.mkdir()
    fake_model(tmp_path / "secret")
    (root / "link").symlink_to(tmp_path / "secret")
    with pytest.raises(ValueError, match="escapes the model directory"):
        resolve_model_dir(None, model_id, None, root=root)


def test_absolute_model_id_is_allowed(tmp_path) -> None:
    model = fake_model(tmp_path / "abs")
    assert resolve_model_dir(None, str(model), None, root=tmp_path / "root") == model


def test_pickle_only_folder_is_refused_with_the_reason(tmp_path) -> None:
    model = fake_model(tmp_path / "p", weights="pytorch_model.bin")
    with pytest.raises(ValueError, match="pytorch_model.bin.*arbitrary code"):
        check_model_dir(model)


def test_sagemaker_model_dir_is_used_when_it_holds_a_model(tmp_path) -> None:
    root = fake_model(tmp_path / "opt-ml-model")
    assert resolve_model_dir(None, None, None, root=root) == root


@pytest.mark.parametrize(("model_id", "message"), [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "model hubs are not reachable"),
])
def test_unreachable_sources_are_refused_clearly(tmp_path, model_id, message) -> None:
    (tmp_path / "root").mkdir()
    with pytest.raises(ValueError, match=message):
        resolve_model_dir(None, model_id, None, root=tmp_path / "root")
