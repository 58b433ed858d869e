"""Bad input found by hand (issue 21): each gets a JSON 4xx naming what is wrong, never a 500."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from handler.config.properties import ConfigError, read_properties
from handler.http.worker import json_error_bytes
from tests.app_harness import served_app
from tests.models_fixtures import build_tiny_model

CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with served_app(build_tiny_model(tmp_path_factory.mktemp("bad-input"))) as (app, _):
        yield app


def error_of(response, code: int) -> str:
    assert response.status_code == code, response.get_data(as_text=True)
    body = response.get_json()
    if "error" in body:  # OpenAI's shape, on the /v1 routes
        body = {**body["error"], "code": response.status_code}
    assert body["code"] == code and "Traceback" not in response.get_data(as_text=True)
    return body["message"]


@pytest.mark.parametrize("route", ["/invocations", "/v1/chat/completions"])
def test_deeply_nested_json_is_a_400_naming_the_body(client, route) -> None:
    deep = b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    message = error_of(client.post(route, data=deep, content_type="application/json"), 400)
    assert "malformed JSON body" in message and "nested too deeply" in message


def test_deeply_nested_json_on_the_sagemaker_path_is_a_model_error_400(client) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    r = client.post("/endpoints/any/invocations", data=deep, content_type="application/json")
    assert r.status_code == 424 and r.get_json()["OriginalStatusCode"] == 400
    assert "nested too deeply" in r.get_json()["OriginalMessage"]


def test_nested_values_below_the_parser_limit_are_refused_briefly(client) -> None:
    """A value nested 500 deep is named in the error, cut short (not echoed whole)."""
    nested = "[" * 500 + "]" * 500
    body = '{"inputs": "x", "parameters": {"top_n_tokens": ' + nested + "}}"
    message = error_of(client.post("/invocations", data=body, content_type="application/json"),
                       400)
    assert "parameters.top_n_tokens" in message and len(message) < 300


@pytest.mark.parametrize("key", ["adapter", "input", "prompt", "max_new_tokens"])
def test_unknown_top_level_fields_are_refused_by_name(client, key) -> None:
    r = client.post("/invocations", json={"inputs": "x", key: 1})
    message = error_of(r, 400)
    assert f"unknown top-level fields: '{key}'" in message
    assert "inputs, parameters, stream" in message


def test_the_documented_top_level_fields_are_accepted(client) -> None:
    body = {"inputs": "x", "parameters": {"max_new_tokens": 2}, "stream": False}
    assert client.post("/invocations", json=body).status_code == 200


def test_text_plain_must_be_utf8(client) -> None:
    r = client.post("/invocations", data=b"caf\xe9 au lait", content_type="text/plain")
    message = error_of(r, 400)
    assert "text/plain" in message and "UTF-8" in message and "byte 3" in message
    ok = client.post("/invocations", data="café".encode(), content_type="text/plain")
    assert ok.status_code == 200


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_chat_errors_name_the_field_the_client_sent(client, field) -> None:
    too_small = client.post("/v1/chat/completions", json={"messages": CHAT, field: 0})
    message = error_of(too_small, 400)
    assert f"{field} must be >= 1" in message and "max_new_tokens" not in message
    too_long = client.post("/v1/chat/completions", json={"messages": CHAT, field: 5000})
    message = error_of(too_long, 400)
    assert f"5000 {field}" in message and "max_new_tokens" not in message
    typed = client.post("/v1/chat/completions", json={"messages": CHAT, field: "many"})
    assert field in error_of(typed, 400)


def test_huge_top_k_is_a_400_not_an_engine_failure(client) -> None:
    body = {"inputs": "x", "parameters": {"top_k": 2**70, "do_sample": True}}
    assert "top_k" in error_of(client.post("/invocations", json=body), 400)


def test_binary_properties_file_fails_naming_the_file(tmp_path) -> None:
    binary = tmp_path / "serving.properties"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    with pytest.raises(ConfigError, match=f"{binary}.*not UTF-8 text.*0x89 at offset 0"):
        read_properties(binary)
    binary.write_bytes(b"option.dtype=fp32\n\x00\x01\x02")
    with pytest.raises(ConfigError, match=f"{binary}.*NUL bytes.*offset 18"):
        read_properties(binary)


def test_gunicorn_errors_are_json() -> None:
    raw = json_error_bytes(431, "Request Header Fields Too Large", "limit request headers")
    head, body = raw.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 431 ") and b"application/json" in head
    assert f"Content-Length: {len(body)}".encode() in head
    error = json.loads(body)
    assert error["code"] == 431 and "8190 bytes" in error["message"]


def test_drain_timeout_from_the_file_or_env_and_its_range() -> None:
    from handler.config.properties import collect_settings, parse_properties
    from handler.config.serving_config import build_serving_config

    def resolve(text: str, env: dict) -> float:
        settings = dict(collect_settings(None, env))
        settings.update(parse_properties(text, "serving.properties"))
        return build_serving_config(settings, Path("/m"), ["LlamaForCausalLM"]).drain_timeout

    assert resolve("", {}) == 30.0
    assert resolve("", {"OPTION_DRAIN_TIMEOUT": "5"}) == 5.0
    assert resolve("option.drain_timeout=0", {"OPTION_DRAIN_TIMEOUT": "5"}) == 0.0
    expected = (r"option.drain_timeout='-1' \(from env OPTION_DRAIN_TIMEOUT\): "
                r"expected a number in \[0, 3600\]")
    with pytest.raises(ConfigError, match=expected):
        resolve("", {"OPTION_DRAIN_TIMEOUT": "-1"})
