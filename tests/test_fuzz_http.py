"""Property-based HTTP fuzzing (hypothesis): random JSON bodies, types, unicode (lone
surrogates, control characters), huge / negative / NaN / infinite numbers, wrong content types,
on every route. Whatever arrives, the answer is < 500, an error is JSON naming what is wrong
with no traceback or file path, and the server stays healthy.

CI size by default (BATCHYARD_FUZZ_EXAMPLES per property); scripts/fuzz.sh runs it long."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import requests
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from benchmark.schemas import SCHEMAS
from tests.app_harness import served_app
from tests.models_fixtures import build_tiny_model
from tests.server_harness import running_server

EXAMPLES = int(os.environ.get("BATCHYARD_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                derandomize=os.environ.get("BATCHYARD_FUZZ_RANDOM") != "1",
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
ROUTES = ["/invocations", "/v1/chat/completions", "/v1/completions",
          "/endpoints/fuzz/invocations", "/endpoints/fuzz/invocations-response-stream"]
# What must never reach a client: a Python traceback or a path into the code.
LEAKS = re.compile(r"Traceback \(most recent|File \"/|site-packages/|\.py\", line \d|"
                   + re.escape(str(Path(__file__).resolve().parent.parent)))

# Text with everything a client can send: control characters, lone surrogates (JSON escapes
# them as \ud800, which is not Unicode text), astral characters.
texts = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
numbers = st.one_of(st.integers(), st.integers(min_value=-2**80, max_value=2**80),
                    st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0, -1, 1, 2**31, 2**63, 10**30, 1e-300, 1e308]))
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(texts, inner, max_size=4)), max_leaves=12)
clean = st.text(st.characters(codec="utf-8"), min_size=1, max_size=40)  # no lone surrogates
words = st.one_of(clean, clean, st.text(st.characters(codec=None, exclude_categories=()),
                                         min_size=1, max_size=40))
# Per field, mostly values of the right type (in and out of range) and sometimes anything, so
# that examples get past the first checks and reach the deeper ones.
ints = st.one_of(st.integers(min_value=-2, max_value=100), st.integers(min_value=0, max_value=8),
                 numbers, scalars)
floats = st.one_of(st.floats(min_value=0.0, max_value=2.0), st.sampled_from([0, 1, 0.5]),
                   numbers, scalars)
flags = st.one_of(st.booleans(), st.booleans(), scalars)
stops = st.one_of(words, st.lists(words, max_size=3), st.lists(scalars, max_size=20), scalars)
PARAMETERS = {**dict.fromkeys(["max_new_tokens", "min_new_tokens", "top_k", "seed",
                               "top_n_tokens", "truncate"], ints),
              **dict.fromkeys(["temperature", "top_p", "repetition_penalty"], floats),
              **dict.fromkeys(["do_sample", "ignore_eos_token", "ignore_eos", "return_full_text",
                               "details", "decoder_input_details", "watermark"], flags),
              "stop_sequences": stops, "stop": stops}
NUMERIC = [name for name, values in PARAMETERS.items() if values in (ints, floats)]
schemas = st.one_of(st.sampled_from([schema for schema, _ in SCHEMAS]), json_values)
GUIDED = {"guided_json": schemas,
          "guided_regex": st.one_of(st.sampled_from(["[0-9]{2}", "(a|b)+", "[", "a{99999}"]),
                                    words, scalars),
          "guided_choice": st.one_of(st.lists(words, max_size=3), json_values),
          "guided_grammar": st.one_of(st.sampled_from(['start: "a"+', "start: x", ""]), words,
                                      scalars)}
PARAMETERS.update(GUIDED, grammar=st.one_of(st.fixed_dictionaries(
    {"type": st.sampled_from(["json", "regex", "xml"]), "value": st.one_of(schemas, words)}),
    json_values))
tool = st.fixed_dictionaries({"type": st.sampled_from(["function", "tool"]),
                              "function": st.fixed_dictionaries(
                                  {"name": st.sampled_from(["f", "g", "bad name"])},
                                  optional={"parameters": schemas})})
STRUCTURED = {**GUIDED, "response_format": st.one_of(st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])},
    optional={"json_schema": st.one_of(st.fixed_dictionaries({"schema": schemas}),
                                       json_values)}), json_values)}
CHAT_FIELDS = {**dict.fromkeys(["max_tokens", "max_completion_tokens", "seed", "top_logprobs",
                                "n"], ints),
               **dict.fromkeys(["temperature", "top_p", "frequency_penalty",
                                "presence_penalty"], floats),
               **dict.fromkeys(["stream", "logprobs", "ignore_eos"], flags),
               "stop": stops, "model": scalars, "user": scalars, **STRUCTURED,
               "tools": st.one_of(st.lists(tool, max_size=2), json_values),
               "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]),
                                        json_values)}


def some_of(fields: dict) -> st.SearchStrategy[dict]:
    """A dict of up to 3 of `fields`, each drawn from its own strategy."""
    return st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({n: fields[n] for n in names}))


generate_bodies = st.fixed_dictionaries(
    {"inputs": st.one_of(words, words, st.lists(words, min_size=1, max_size=3), json_values)},
    optional={"parameters": st.one_of(some_of(PARAMETERS), some_of(PARAMETERS), json_values),
              "stream": flags})
unknown_field_bodies = st.tuples(generate_bodies, texts, json_values).map(
    lambda t: {**t[0], t[1]: t[2]})
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                 "content": words})
messages = st.lists(st.one_of(message, message, message, json_values), min_size=1, max_size=3)
chat_bodies = st.tuples(st.one_of(messages, messages, json_values), some_of(CHAT_FIELDS)).map(
    lambda t: {"messages": t[0], **t[1]})
COMPLETION_FIELDS = {**CHAT_FIELDS, "logprobs": ints, "echo": flags, "best_of": ints,
                     "stream_options": st.one_of(st.fixed_dictionaries(
                         {"include_usage": flags}), json_values)}
completion_bodies = st.tuples(st.one_of(words, st.lists(words, min_size=1, max_size=3),
                                        json_values), some_of(COMPLETION_FIELDS)).map(
    lambda t: {"prompt": t[0], **t[1]})
bodies = st.one_of(generate_bodies, generate_bodies, unknown_field_bodies, chat_bodies,
                   chat_bodies, completion_bodies, completion_bodies, json_values)
content_types = st.sampled_from(["application/json", "application/json; charset=utf-8",
                                 "text/plain", "application/x-www-form-urlencoded",
                                 "application/octet-stream", "application/vnd+json", ""])
accepts = st.sampled_from(["", "application/json", "application/jsonlines",
                           "text/event-stream", "*/*", "image/png"])


def encode(body) -> bytes:
    """JSON as a client might write it: NaN/Infinity included; lone surrogates escaped."""
    return json.dumps(body, allow_nan=True).encode()


def check_answer(status: int, body: bytes, content_type: str) -> None:
    text = body.decode("utf-8", errors="replace")
    assert status < 500, text
    if status < 400:  # generated text is random: only error bodies are checked for leaks
        return
    assert not LEAKS.search(text), text
    error = json.loads(body)
    if status == 424:  # the SageMaker paths: ModelError with the container's own answer
        assert error["OriginalStatusCode"] < 500
        error = json.loads(error["OriginalMessage"])
    if isinstance(error.get("error"), dict):  # OpenAI's shape, on the /v1 routes
        error = error["error"]
        assert isinstance(error["code"], str) and error["code"]
    else:
        assert isinstance(error["code"], int) and error["code"] < 500
    assert isinstance(error["type"], str) and error["type"]
    assert isinstance(error["message"], str) and error["message"].strip()


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    model = build_tiny_model(tmp_path_factory.mktemp("fuzz-model"))
    with served_app(model, predict_timeout=60.0) as (client, state):
        yield client, state
        assert state.engine.gauges().num_in_flight == 0


def post(client, route: str, data: bytes, content_type: str, accept: str = ""):
    headers = {"Accept": accept} if accept else {}
    r = client.post(route, data=data, content_type=content_type or None, headers=headers)
    return r.status_code, r.get_data(), r.headers.get("Content-Type", "")


@FUZZ
@given(route=st.sampled_from(ROUTES), body=bodies, accept=accepts)
def test_json_bodies_on_every_route(app, route, body, accept) -> None:
    client, _ = app
    check_answer(*post(client, route, encode(body), "application/json", accept))


@FUZZ
@given(route=st.sampled_from(ROUTES), data=st.binary(max_size=200), content_type=content_types)
def test_any_bytes_under_any_content_type(app, route, data, content_type) -> None:
    client, _ = app
    check_answer(*post(client, route, data, content_type))


@FUZZ
@given(body=generate_bodies)
def test_refusals_name_the_field(app, body) -> None:
    """A refused generate body's message names a field of the body (or the body itself)."""
    client, _ = app
    status, data, content_type = post(client, "/invocations", encode(body), "application/json")
    check_answer(status, data, content_type)
    if status == 400:
        message = json.loads(data)["message"]
        names = {"inputs", "parameters", "stream", "JSON", "body", *body,
                 *(body.get("parameters") if isinstance(body.get("parameters"), dict) else ())}
        assert any(str(name)[:40] in message for name in names), message


@FUZZ
@given(inputs=clean, name=st.sampled_from(sorted(NUMERIC)),
       value=st.one_of(numbers, st.sampled_from([2**31, 2**63, -2**63, 10**30, 2**64 + 1])),
       sampled=st.booleans())
@example(inputs="x", name="top_k", value=10**30, sampled=True)  # once a 500 (int64 overflow)
@example(inputs="x", name="seed", value=2**64 + 1, sampled=True)
@example(inputs="x", name="truncate", value=2**63, sampled=False)
def test_extreme_numbers_in_any_parameter(app, inputs, name, value, sampled) -> None:
    """A well-formed request but for one number: huge, negative, tiny, NaN or infinite."""
    client, _ = app
    parameters = {"max_new_tokens": 4, "do_sample": sampled, name: value}
    body = {"inputs": inputs, "parameters": parameters}
    check_answer(*post(client, "/invocations", encode(body), "application/json"))


@FUZZ
@given(method=st.sampled_from(["GET", "PUT", "DELETE", "PATCH"]),
       path=st.sampled_from([*ROUTES, "/ping", "/metrics", "/", "/nope", "/endpoints//x"]))
def test_other_methods_and_paths(app, method, path) -> None:
    client, _ = app
    r = client.open(path, method=method)
    check_answer(r.status_code, r.get_data(), r.headers.get("Content-Type", ""))


def test_healthy_after_fuzzing(app) -> None:
    """Runs after the properties (file order): the app still serves a plain request."""
    client, state = app
    assert client.get("/ping").status_code == 200
    r = client.post("/invocations", json={"inputs": "hello", "parameters": {"max_new_tokens": 3}})
    assert r.status_code == 200 and "generated_text" in r.get_json()
    assert state.engine.gauges().kv_blocks_used == 0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = build_tiny_model(tmp_path_factory.mktemp("fuzz-srv-model"))
    props = "option.rolling_batch=paged\noption.max_model_len=96\noption.block_size=4\n"
    with running_server(tmp_path_factory.mktemp("fuzz-srv"), model, props) as srv:
        yield srv


@pytest.mark.slow
@settings(FUZZ, max_examples=max(10, EXAMPLES // 4))
@given(route=st.sampled_from(ROUTES), body=bodies, content_type=content_types)
def test_gunicorn_smoke(server, route, body, content_type) -> None:
    """The same through a real gunicorn server (paged), fewer examples: sockets are slow."""
    r = requests.post(f"{server.url}{route}", data=encode(body), timeout=60,
                      headers={"Content-Type": content_type} if content_type else {})
    check_answer(r.status_code, r.content, r.headers.get("Content-Type", ""))
    assert requests.get(f"{server.url}/ping", timeout=10).status_code == 200
