"""option.input_formatter / option.output_formatter naming model.py functions: applied around
batchyard's engine in every batching strategy, the scheduler unchanged."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import requests

from tests.models_fixtures import build_tiny_model
from tests.server_harness import running_server

pytestmark = pytest.mark.slow

FORMATTERS = Path(__file__).resolve().parent / "fixtures" / "lmi_handlers" / "formatters"
STRATEGIES = {
    "none": "", "dynamic": "batch_size=4\nmax_batch_delay=10\n",
    "continuous": "option.rolling_batch=scheduler\n",
    "paged": "option.rolling_batch=paged\noption.max_rolling_batch_prefill_tokens=64\n",
}
KEYS = "option.input_formatter=my_input\noption.output_formatter=my_output\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = build_tiny_model(tmp_path_factory.mktemp("fmt-model"))
    shutil.copy(FORMATTERS / "model.py", folder / "model.py")
    return folder


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_custom_formatters_wrap_every_strategy(model_dir, tmp_path, strategy) -> None:
    with running_server(tmp_path, model_dir, STRATEGIES[strategy] + KEYS) as srv:
        body = {"question": "What is the capital of France?",
                "options": {"max_new_tokens": 4, "ignore_eos": True}}
        r = requests.post(f"{srv.url}/invocations", json=body, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["shape"] == "mine" and isinstance(out["answer"], str)
        # The same prompt in the built-in schema gives the same text: only the shape changed.
        plain = requests.post(f"{srv.url}/invocations", timeout=60, json={
            "inputs": "Q: What is the capital of France?\nA:", "parameters": body["options"]})
        assert plain.json()["answer"] == out["answer"]
        refused = requests.post(f"{srv.url}/invocations", json={"question": 1}, timeout=60)
        assert refused.status_code == 400 and "my_input" in refused.json()["message"]
        if strategy == "paged":
            stream = requests.post(f"{srv.url}/invocations", json={**body, "stream": True},
                                   timeout=60)
            assert stream.text == out["answer"]  # one text piece per token, concatenated
            # user code never runs on the engine's output thread, which serves every stream
            srv.wait_metric('batchyard_streamed_requests_total{writer="request_thread"}', 1)
        assert f"strategy={strategy}" in srv.log()


def test_a_missing_formatter_function_fails_start_up(model_dir, tmp_path) -> None:
    props = "option.output_formatter=not_there\n"
    with running_server(tmp_path, model_dir, props, wait_ready=False) as srv:
        assert srv.process.wait(timeout=90) != 0
    assert "option.output_formatter=not_there: model.py defines no such function" in srv.log()


def custom_code(folder: Path, text: str):
    from handler.config.properties import parse_properties
    from handler.config.serving_config import build_serving_config
    from handler.lmi.loader import load_custom_code

    config = build_serving_config(parse_properties(text, "serving.properties"), folder, [])
    return load_custom_code(config)


def test_lmi_builtin_entry_point_keeps_the_engine_and_model_py_formatters(tmp_path) -> None:
    shutil.copy(FORMATTERS / "model.py", tmp_path / "model.py")
    code = custom_code(tmp_path, "option.entryPoint=djl_python.huggingface\n" + KEYS)
    assert code.runner is None
    assert code.formatters.request({"question": "q"})["inputs"] == "Q: q\nA:"


def test_keys_the_chosen_mode_does_not_read_are_logged(tmp_path, caplog) -> None:
    shutil.copy(FORMATTERS / "model.py", tmp_path / "model.py")
    custom_code(tmp_path, "option.handler=predict\nmaxWorkers=4\n")
    warned = " ".join(r.message for r in caplog.records)
    assert "option.handler has no effect" in warned and "maxWorkers has no effect" in warned
