"""Smoke test of the embedded default model (SmolLM2-135M-Instruct) through the real server."""

from __future__ import annotations

import pytest
import requests

from handler.model_source.default_model import MODEL_NAME, ensure_default_model
from tests.server_harness import first_answer, running_server, wait_for_ping

pytestmark = pytest.mark.slow


def test_default_model_is_built_in_the_background_then_names_paris(tmp_path) -> None:
    """No --model-dir and an empty cache: the server binds at once, answers /ping 503 while it
    converts the default model, then serves it; the conversion is byte-for-byte reproducible."""
    cache = tmp_path / "cache"
    props = "option.rolling_batch=paged\noption.max_model_len=512\n"
    with running_server(tmp_path, None, props, env={"BATCHYARD_CACHE_DIR": str(cache)},
                        wait_ready=False) as srv:
        assert first_answer(f"{srv.url}/ping", timeout=120).status_code == 503
        wait_for_ping(srv, timeout=300)
        body = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 24}
        r = requests.post(f"{srv.url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        answer = r.json()["choices"][0]["message"]["content"]
        assert "Paris" in answer, answer
        assert r.json()["model"] == MODEL_NAME
    built = cache / "models" / MODEL_NAME
    reference = ensure_default_model()  # the machine's own cache, built once and reused
    names = sorted(p.name for p in reference.iterdir())
    assert names == sorted(p.name for p in built.iterdir())
    for name in names:
        assert (built / name).read_bytes() == (reference / name).read_bytes(), name
