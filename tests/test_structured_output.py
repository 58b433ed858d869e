"""Structured output and tool calls through a real server (gunicorn, tiny random model, paged
and continuous) with the official openai client: 20 JSON schemas that jsonschema validates,
json_object, regex, choice, Lark, TGI's grammar on /invocations, forced and automatic tool
calls whole and streamed, and 400s naming the field."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
import requests

from benchmark.schemas import SCHEMAS
from tests.models_fixtures import build_tiny_model
from tests.server_harness import running_server

ASK = [{"role": "user", "content": "Answer in JSON."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module", params=["paged", "scheduler"])
def server(request, tmp_path_factory):
    # room for a tools system message, which the tiny tokenizer spells nearly byte by byte
    path = build_tiny_model(tmp_path_factory.mktemp("structured-model"),
                            max_position_embeddings=1024)
    properties = (f"option.rolling_batch={request.param}\noption.max_rolling_batch_size=8\n"
                  "option.max_model_len=1024\n")
    with running_server(tmp_path_factory.mktemp("structured"), path, properties) as srv:
        yield srv, openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)


def chat(server, **body):
    return server[1].chat.completions.create(model="m", messages=ASK, max_tokens=100, **body)


def test_twenty_json_schemas_give_valid_json(server) -> None:
    for i, (schema, _) in enumerate(SCHEMAS):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                      "strict": True}}
        [choice] = chat(server, response_format=fmt).choices
        assert choice.finish_reason == "stop", (i, choice)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_streamed_json_equals_the_whole_answer(server) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS[7][0]}}
    whole = chat(server, response_format=fmt).choices[0].message.content
    chunks = list(chat(server, response_format=fmt, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole


def test_json_object_regex_choice_and_grammar(server) -> None:
    answer = chat(server, response_format={"type": "json_object"}).choices[0].message.content
    assert isinstance(json.loads(answer), dict)
    anything = chat(server, extra_body={"guided_json": True}).choices[0]  # the schema `true`
    assert anything.finish_reason == "length" or json.loads(anything.message.content) is not None
    api = server[1]

    def complete(**extra) -> str:
        return api.completions.create(model="m", prompt="Say:", max_tokens=40,
                                      extra_body=extra).choices[0].text

    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", complete(guided_regex=r"[a-z]{3}-[0-9]{2}"))
    assert complete(guided_choice=["up", "down"]) in ("up", "down")
    assert re.fullmatch(r"(ab)+!", complete(guided_grammar='start: ("ab")+ "!"'))
    schema = SCHEMAS[4][0]
    jsonschema.validate(json.loads(complete(guided_json=schema)), schema)


def test_tgi_grammar_and_guided_names_on_invocations(server) -> None:
    url = f"{server[0].url}/invocations"
    schema = SCHEMAS[0][0]
    for parameters, check in [
        ({"grammar": {"type": "json", "value": schema}},
         lambda text: jsonschema.validate(json.loads(text), schema)),
        ({"grammar": {"type": "regex", "value": "[0-9]{4}"}},
         lambda text: re.fullmatch("[0-9]{4}", text) or pytest.fail(text)),
        ({"guided_choice": ["yes", "no"]}, lambda text: text in ("yes", "no") or pytest.fail())]:
        r = requests.post(url, json={"inputs": "Q:", "parameters": {"max_new_tokens": 60,
                                                                     **parameters}}, timeout=60)
        assert r.status_code == 200, r.text
        check(r.json()["generated_text"])


@pytest.mark.parametrize(("body", "field"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "frob"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "at most one of"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "cannot be combined"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice names no function"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0]"),
    ({"tools": [WEATHER, WEATHER]}, "distinct function names"),
    # compiles alone, not with this tokenizer: checked with it before the request is queued
    ({"guided_grammar": "start: <|no_such_token|>"}, "guided_grammar does not compile"),
    ({"guided_json": False}, "no answer could match"),
    ({"guided_json": "[" * 5000}, "nested too deeply"),
    ({"prompt": "a chat route takes messages"}, "field messages is required"),
])
def test_bad_structured_fields_are_400s_naming_the_field(server, body, field) -> None:
    base = {} if "prompt" in body else {"messages": ASK}
    r = requests.post(f"{server[0].url}/v1/chat/completions", timeout=30,
                      json={**base, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


def test_a_forced_tool_call_has_valid_arguments(server) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        [answer] = chat(server, tools=[WEATHER, TIME], tool_choice=choice).choices
        assert answer.finish_reason == "tool_calls" and answer.message.content is None
        [call] = answer.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function"
        spec = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments),
                            spec["function"]["parameters"])
        if isinstance(choice, dict):
            assert call.function.name == "get_weather"


def test_a_streamed_tool_call_assembles_into_the_whole_answer(server) -> None:
    body = {"tools": [WEATHER], "tool_choice": "required", "temperature": 0}
    [whole] = chat(server, **body).choices[0].message.tool_calls
    chunks = list(chat(server, stream=True, **body))
    entries = [e for c in chunks if c.choices for e in c.choices[0].delta.tool_calls or []]
    assert entries[0].function.name == "get_weather" and entries[0].id.startswith("call_")
    arguments = "".join(e.function.arguments or "" for e in entries)
    assert arguments == whole.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_answers_text_or_one_valid_call_and_history_with_calls_is_accepted(
        server) -> None:
    for prompt in ("Weather in Paris?", "Hello", "What time is it in utc?"):
        [answer] = server[1].chat.completions.create(
            model="m", messages=[{"role": "user", "content": prompt}], max_tokens=60,
            tools=[WEATHER, TIME]).choices
        if answer.message.tool_calls:
            assert answer.finish_reason == "tool_calls"
            json.loads(answer.message.tool_calls[0].function.arguments)
        else:
            assert not answer.message.content.startswith("<")
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5 degrees"}]
    answer = server[1].chat.completions.create(model="m", messages=history, max_tokens=5,
                                               tools=[WEATHER], tool_choice="none")
    assert answer.choices[0].message.tool_calls is None
