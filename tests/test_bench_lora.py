"""`batchyard bench lora` on a tiny model: its random PEFT adapters load in the engine, and its
table and JSON carry every run with its ratio to the base model."""

from __future__ import annotations

import json

from benchmark.cli import main
from benchmark.lora import write_adapter
from engine import EngineConfig, LLMEngine
from tests.models_fixtures import build_tiny_model


def test_random_adapters_are_peft_folders_the_engine_takes(tmp_path) -> None:
    model = build_tiny_model(tmp_path / "model")
    folder = write_adapter(tmp_path / "a", model, 8, seed=1)  # every projection
    engine = LLMEngine.from_config(EngineConfig(model=str(model), batching="paged",
                                                max_num_seqs=2, max_model_len=64,
                                                device="cpu", enable_lora=True,
                                                max_lora_rank=8))
    engine.add_adapter("a", str(folder))
    assert engine.adapter_names() == ["a"]
    assert len(engine.runner.adapters.get("a@1").modules) == 7 * 2  # every projection, 2 layers


def test_the_command_reports_every_run_against_the_base_model(tmp_path, capsys) -> None:
    model = build_tiny_model(tmp_path / "model")
    out = tmp_path / "out"
    assert main(["lora", "--model-dir", str(model), "--adapters", "1,2", "--ranks", "8",
                 "--clients", "4", "--requests", "6", "--prompt-tokens", "5",
                 "--new-tokens", "4", "--device", "cpu", "--out", str(out)]) == 0
    results = json.loads((out / "lora.json").read_text())
    assert [(r["adapters"], r["rank"]) for r in results["runs"]] == [(0, 0), (1, 8), (2, 8)]
    assert all(r["ratio_to_base"] > 0 for r in results["runs"][1:])
    assert "| base model | – |" in (out / "lora.md").read_text()
    assert "| 2 | 8 |" in capsys.readouterr().out
