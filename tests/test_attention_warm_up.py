"""Compiled attention stays compiled once serving starts: no step recompiles a size the warm-up
compiled. Compiled graphs guard on the number of types torch's pytree knows, so an import after
the warm-up (transformers' model outputs, on the first tokenizer load) made every size
recompile once in a served step: 0.3-0.7 s pauses of every stream on an H100. FlexAttention
warms up on CUDA only; here it is warmed up on the CPU too (three small sizes)."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

import engine.runner.attention_check as check
from engine import EngineConfig, LLMEngine
from engine.text.tokenizer_files import TokenizerLoadError
from tests.models_fixtures import build_tiny_model

ROOT = Path(__file__).resolve().parent.parent
CONFIG = {"batching": "paged", "dtype": "float32", "device": "cpu", "max_num_seqs": 2,
          "max_model_len": 96, "num_kv_blocks": 64, "attention_backend": "flex",
          "max_num_batched_tokens": 32}  # up to 32 + 2 x 15 padded rows: sizes 16, 32 and 64
WARMED_ROWS, WARMED_SIZES = 62, 3

# A fresh process, as a server's core is: nothing imported but what the engine imports.
SERVE_IN_A_FRESH_PROCESS = """
import json, sys
import torch
from torch._dynamo.utils import counters
import engine.runner.attention_check as check
check.WARM_UP_DEVICES = ("cuda", "cpu")
from engine import EngineConfig, LLMEngine, SamplingParams
engine = LLMEngine.from_config(EngineConfig(model=sys.argv[1], **json.loads(sys.argv[2])))
warmed = engine.runner.attention.warmed_up
compiled = counters["stats"]["unique_graphs"]
for i, n in enumerate([5, 9, 14, 20, 3]):
    engine.add_request(f"r{i}", list(range(3, 3 + n)),
                       SamplingParams(max_new_tokens=6, min_new_tokens=6))
while engine.has_unfinished():
    engine.step()
print(json.dumps({"warmed": warmed,
                  "recompiled": counters["stats"]["unique_graphs"] - compiled}))
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("warm-up-model"))


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                         reason="needs a CUDA GPU"))])
def test_served_steps_compile_nothing_in_a_fresh_process(model_dir, device) -> None:
    config = {**CONFIG, "device": device, "dtype": "float32" if device == "cpu" else "bfloat16"}
    done = subprocess.run([sys.executable, "-c", SERVE_IN_A_FRESH_PROCESS, str(model_dir),
                           json.dumps(config)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["warmed"][0] == WARMED_ROWS  # the warm-up ran, up to the padded step budget
    assert result["recompiled"] == 0


class Registered:
    """A type registered with torch's pytree after the warm-up, as an import would."""


def test_refresh_compiles_again_once_the_pytree_registry_changed(model_dir, monkeypatch,
                                                                 caplog) -> None:
    monkeypatch.setattr(check, "WARM_UP_DEVICES", ("cuda", "cpu"))
    engine = LLMEngine.from_config(EngineConfig(model=str(model_dir), **CONFIG))
    runner = engine.runner
    try:
        assert not check.refresh_warm_up(runner)  # nothing changed since the warm-up
        torch.utils._pytree.register_pytree_node(
            Registered, lambda x: ([], None), lambda children, context: Registered())
        try:
            compiled = counters["stats"]["unique_graphs"]
            with caplog.at_level(logging.WARNING, "engine.runner.attention_check"):
                assert check.refresh_warm_up(runner)
            # The premise: the change invalidated every warmed size (they compiled again) ...
            assert counters["stats"]["unique_graphs"] == compiled + WARMED_SIZES
            assert "pytree registry went from" in caplog.text
            compiled = counters["stats"]["unique_graphs"]
            check.warm_up_attention(runner, WARMED_ROWS)  # ... and steps of those sizes now do not
            assert counters["stats"]["unique_graphs"] == compiled
            assert not check.refresh_warm_up(runner)
        finally:
            torch.utils._pytree._deregister_pytree_node(Registered)
    finally:
        engine.close()


def test_a_broken_tokenizer_still_fails_the_engine_after_the_model_loads(model_dir, tmp_path,
                                                                       monkeypatch) -> None:
    """The tokenizer loads first (above), but its error waits for the model's checks, which
    name what cannot be served; a servable model then fails with the tokenizer's error and
    frees what it built."""
    import engine.llm_engine as llm_engine

    broken = tmp_path / "broken-tokenizer"
    shutil.copytree(model_dir, broken)
    (broken / "tokenizer.json").write_text("{not json")
    closed = []
    monkeypatch.setattr(llm_engine, "close_runner", lambda runner: closed.append(runner))
    with pytest.raises(TokenizerLoadError, match="tokenizer.json is not valid JSON"):
        LLMEngine.from_config(EngineConfig(model=str(broken), batching="paged", device="cpu",
                                           dtype="float32", max_model_len=96))
    assert len(closed) == 1


def test_a_thread_core_refreshes_before_its_first_step(model_dir, monkeypatch, caplog) -> None:
    """EngineClient(engine).start(): the core thread's start compiles again, as a core process
    does before it is ready, when the registry changed after the warm-up."""
    from engine import EngineClient

    monkeypatch.setattr(check, "WARM_UP_DEVICES", ("cuda", "cpu"))
    client = EngineClient(LLMEngine.from_config(EngineConfig(model=str(model_dir), **CONFIG)),
                          max_queued=2)
    torch.utils._pytree.register_pytree_node(
        Registered, lambda x: ([], None), lambda children, context: Registered())
    try:
        with caplog.at_level(logging.WARNING, "engine.runner.attention_check"):
            client.start()
        assert "pytree registry went from" in caplog.text
    finally:
        client.shutdown(grace_seconds=0)
        torch.utils._pytree._deregister_pytree_node(Registered)
