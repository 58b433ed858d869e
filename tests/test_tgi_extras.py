"""TGI request extras (truncate, top_n_tokens, decoder_input_details, watermark) and
option.tgi_compat's response shapes, through a real gunicorn server."""

from __future__ import annotations

import json

import pytest
import requests

from tests.models_fixtures import build_tiny_model
from tests.server_harness import running_server

pytestmark = pytest.mark.slow

CONTINUOUS = "option.rolling_batch=scheduler\noption.max_rolling_batch_size=4\n"
PROMPT = "The capital of France is Paris. The capital of Japan is"


def post(url: str, body, **kw) -> requests.Response:
    return requests.post(f"{url}/invocations", json=body, timeout=60, **kw)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tgi-model"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("srv"), model_dir, CONTINUOUS) as srv:
        yield srv


def test_truncate_keeps_the_last_tokens(server) -> None:
    params = {"max_new_tokens": 3, "ignore_eos": True, "details": True}
    whole = post(server.url, {"inputs": PROMPT, "parameters": params}).json()
    cut = post(server.url, {"inputs": PROMPT, "parameters": {**params, "truncate": 4}}).json()
    assert whole["details"]["inputs"] > 4 and cut["details"]["inputs"] == 4


def test_top_n_tokens_and_decoder_input_details(server) -> None:
    params = {"max_new_tokens": 3, "ignore_eos": True, "top_n_tokens": 2,
              "decoder_input_details": True}
    out = post(server.url, {"inputs": PROMPT, "parameters": params}).json()
    details = out["details"]  # decoder_input_details implies details
    assert len(details["top_tokens"]) == 3 and all(len(row) == 2 for row in details["top_tokens"])
    assert {"id", "text", "log_prob"} <= set(details["top_tokens"][0][0])
    assert len(details["prefill"]) == details["inputs"]
    r = post(server.url, {"inputs": PROMPT, "stream": True,
                          "parameters": {"max_new_tokens": 2, "top_n_tokens": 1}})
    lines = [json.loads(line) for line in r.iter_lines() if line]
    assert all(len(line["top_tokens"]) == 1 for line in lines)


def test_return_full_text_and_watermark_false_are_accepted(server) -> None:
    params = {"max_new_tokens": 2, "return_full_text": True, "watermark": False}
    out = post(server.url, {"inputs": PROMPT, "parameters": params})
    assert out.status_code == 200 and out.json()["generated_text"].startswith(PROMPT)


@pytest.mark.parametrize(("params", "stream", "words"), [
    ({"watermark": True}, False, "watermark is not supported"),
    ({"decoder_input_details": True}, True, "not supported when streaming"),
    ({"truncate": 0}, False, "truncate must be >= 1"),
    ({"top_n_tokens": 99}, False, "top_n_tokens must be between 0 and 20"),
    ({"truncate": "x"}, False, "truncate must be an integer"),
])
def test_bad_extras_are_400_naming_the_field(server, params, stream, words) -> None:
    r = post(server.url, {"inputs": PROMPT, "parameters": params, "stream": stream})
    assert r.status_code == 400 and words in r.json()["message"]


def test_tgi_compat_answers_tgi_shapes(model_dir, tmp_path) -> None:
    with running_server(tmp_path, model_dir, CONTINUOUS + "option.tgi_compat=true\n") as srv:
        params = {"max_new_tokens": 3, "ignore_eos": True, "seed": 5}
        out = post(srv.url, {"inputs": PROMPT, "parameters": params}).json()
        assert isinstance(out, list) and len(out) == 1  # a list, details on by default
        details = out[0]["details"]
        assert details["finish_reason"] == "length" and details["seed"] == 5
        assert {"id", "text", "logprob", "special"} == set(details["tokens"][0])
        r = post(srv.url, {"inputs": PROMPT, "parameters": params, "stream": True})
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = [json.loads(e[len(b"data: "):]) for e in r.iter_lines() if e]
        assert [e["index"] for e in events] == [0, 1, 2]
        assert events[0]["generated_text"] is None and events[0]["details"] is None
        assert events[-1]["generated_text"] == out[0]["generated_text"]
        assert events[-1]["details"]["input_length"] > 0


def test_jsonlines_output_formatter_streams_by_default(model_dir, tmp_path) -> None:
    props = CONTINUOUS + "option.output_formatter=jsonlines\n"
    with running_server(tmp_path, model_dir, props) as srv:
        r = post(srv.url, {"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
        assert r.headers["Content-Type"].startswith("application/jsonlines")
        assert len([line for line in r.iter_lines() if line]) <= 2
        listed = post(srv.url, {"inputs": [PROMPT, PROMPT], "parameters": {"max_new_tokens": 2}})
        assert isinstance(listed.json(), list)  # a list of inputs is answered whole
