"""Overload: prompts too long to fit are refused before tokenizing, a long tokenization does not
hold up the others, and a full engine refuses (503 + Retry-After) before any tokenizing."""

from __future__ import annotations

import threading

import pytest

from engine.text.tokenizer_pool import MAX_CHARS_PER_TOKEN, POOL_SIZE, TAIL_SLACK_TOKENS
from tests.app_harness import served_app
from tests.engine_harness import MAX_MODEL_LEN
from tests.models_fixtures import build_tiny_model

LIMIT = MAX_MODEL_LEN * MAX_CHARS_PER_TOKEN


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with served_app(build_tiny_model(tmp_path_factory.mktemp("overload-model"))) as app_state:
        yield app_state


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(served, monkeypatch) -> None:
    client, state = served
    calls = []
    monkeypatch.setattr(state.engine._tokenizers, "borrow",
                        lambda: calls.append(1) or pytest.fail("tokenized"))
    r = client.post("/invocations", json={"inputs": "x" * (LIMIT + 1)})
    assert r.status_code == 400 and calls == []
    assert f"inputs has {LIMIT + 1} characters; at most {LIMIT}" in r.get_json()["message"]
    chat = client.post("/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "x" * (LIMIT + 1)}]})
    assert chat.status_code == 400 and "messages has" in chat.get_json()["error"]["message"]


def test_truncate_keeps_a_long_prompt_servable(served) -> None:
    client, _ = served
    body = {"inputs": "a b " * LIMIT, "parameters": {"truncate": 8, "max_new_tokens": 2}}
    r = client.post("/invocations", json=body)
    assert r.status_code == 200, r.get_data(as_text=True)


def test_a_huge_truncate_prompt_tokenizes_only_its_tail(served, monkeypatch) -> None:
    """A few MB with truncate is not seconds of tokenizing that a small request beside it
    waits behind: only a window of its tail reaches the tokenizer, whatever its size."""
    client, state = served
    pool = state.engine._tokenizers
    lengths: list[int] = []
    encode = pool._encode
    monkeypatch.setattr(pool, "_encode", lambda tok, text, add: lengths.append(len(text))
                        or encode(tok, text, add))
    huge = "The capital of France is Paris. " * 100_000  # 3.2 MB
    r = client.post("/invocations", json={"inputs": huge, "parameters": {
        "truncate": 8, "max_new_tokens": 2, "details": True, "decoder_input_details": True}})
    assert r.status_code == 200, r.get_data(as_text=True)
    assert 0 < sum(lengths) <= (8 + TAIL_SLACK_TOKENS) * MAX_CHARS_PER_TOKEN * 2
    assert len(r.get_json()["details"]["prefill"]) == 8
    lengths.clear()
    small = client.post("/invocations", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}})
    assert small.status_code == 200 and lengths == [2]
    # a truncate past max_model_len still tokenizes a bounded tail, and is refused by name
    r = client.post("/invocations", json={"inputs": huge, "parameters": {
        "truncate": 10**6, "max_new_tokens": 2}})
    assert r.status_code == 400 and "truncate=1000000" in r.get_json()["message"]
    assert sum(lengths) <= (MAX_MODEL_LEN + 1 + TAIL_SLACK_TOKENS) * MAX_CHARS_PER_TOKEN * 3


def test_tokenizers_busy_with_long_prompts_leave_one_for_a_short_one(served) -> None:
    """Every pool copy but one is held (as by long tokenizations): a short request still gets
    tokenized and answered; with one shared lock it would wait for them."""
    client, state = served
    pool = state.engine._tokenizers
    held = [pool.borrow() for _ in range(POOL_SIZE - 1)]
    for borrowed in held:
        borrowed.__enter__()
    answer = {}
    try:
        worker = threading.Thread(target=lambda: answer.update(r=client.post(
            "/invocations", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}})))
        worker.start()
        worker.join(timeout=60)  # liveness bound only
        assert answer["r"].status_code == 200
    finally:
        for borrowed in held:
            borrowed.__exit__(None, None, None)


def test_a_full_engine_refuses_before_tokenizing(served, monkeypatch) -> None:
    client, state = served
    monkeypatch.setattr(state.engine._loop, "capacity", 0)  # as if every slot were taken
    monkeypatch.setattr(state.engine._tokenizers, "borrow", lambda: pytest.fail("tokenized"))
    for route, body in [("/invocations", {"inputs": "hello"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                "content": "hello"}]})]:
        r = client.post(route, json=body)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        error = r.get_json().get("error") or {**r.get_json(), "code": r.get_json()["type"]}
        assert error["code"] == "QueueFull" and "job_queue_size" in error["message"]
