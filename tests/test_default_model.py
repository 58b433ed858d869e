"""Smoke test of the embedded default model (SmolLM2-135M-Instruct) through the real server."""

from __future__ import annotations

import pytest
import requests

from handler.default_model import ensure_default_model
from tests.server_harness import running_server

pytestmark = pytest.mark.slow


def test_default_model_answers_the_capital_of_france(tmp_path) -> None:
    """No --model-dir: the server converts (once) and serves the default model."""
    ensure_default_model()  # built once per machine (~25 s) and reused from the cache
    props = "option.rolling_batch=paged\noption.max_model_len=512\n"
    with running_server(tmp_path, None, props, timeout=180) as srv:
        body = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 24}
        r = requests.post(f"{srv.url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        answer = r.json()["choices"][0]["message"]["content"]
        assert "Paris" in answer, answer
        assert "SmolLM2-135M-Instruct" in r.json()["model"]


def test_default_model_build_is_deterministic(tmp_path) -> None:
    """A second conversion into another cache gives byte-identical files."""
    first = ensure_default_model()
    second = ensure_default_model(tmp_path)
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
