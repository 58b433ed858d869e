"""Every grammar, schema or regex a client sends ends in a result or a 4xx naming its field:
one with no finite string (`start: "a" start`, a schema that requires itself) or an empty
regex is refused before it is queued, on every route and through every field; one that fails
further on than the check follows ends its request with a 400 (not a 500), logged. Then a
property-based fuzz over the guided-decoding fields with edge values: never a 5xx."""

from __future__ import annotations

import json
import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

import engine.guided
from benchmark.schemas import SCHEMAS
from tests.app_harness import served_app
from tests.models_fixtures import build_tiny_model
from tests.test_fuzz_http import FUZZ, check_answer, json_values, words

ENDLESS = 'start: "a" start'
EMPTY_REGEX = r"[^\x00-\U0010FFFF]"
SELF_REQUIRED = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
LATE = 'start: "a" "b" "c" "d" "e" "f" "g" "h" "i" "j" x\nx: "q" x'


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    model = build_tiny_model(tmp_path_factory.mktemp("guided-refusals-model"))
    with served_app(model, "paged", predict_timeout=60.0) as (client, state):
        yield client, state
        assert state.engine.gauges().num_in_flight == 0


def ask(client, route: str, fields: dict, max_tokens: int = 4, stream: bool = False):
    """POST `fields` (guided ones) on `route` in its own body shape."""
    if route == "/invocations":
        body: dict = {"inputs": "Say:", "parameters": {"max_new_tokens": max_tokens, **fields}}
    elif route == "/v1/chat/completions":
        body = {"messages": [{"role": "user", "content": "Say:"}], "max_tokens": max_tokens,
                **fields}
    else:
        body = {"prompt": "Say:", "max_tokens": max_tokens, **fields}
    if stream:
        body["stream"] = True
    return client.post(route, data=json.dumps(body), content_type="application/json")


def message(r) -> str:
    body = r.get_json()
    return body["error"]["message"] if isinstance(body.get("error"), dict) else body["message"]


ROUTES = ["/invocations", "/v1/chat/completions", "/v1/completions"]


@pytest.mark.parametrize("route", ROUTES)
def test_a_grammar_with_no_finite_string_is_a_400_naming_the_field(app, route) -> None:
    r = ask(app[0], route, {"guided_grammar": ENDLESS})
    assert r.status_code == 400, r.get_data()
    assert message(r).endswith("guided_grammar matches no finite string: rule start cannot end "
                               "(each alternative leads back into itself); give one an "
                               'alternative that does, e.g. `x: "a" x | "a"`')


@pytest.mark.parametrize(("route", "fields", "field"), [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "loop", "schema": SELF_REQUIRED}}}, "response_format.json_schema.schema"),
    ("/v1/completions", {"guided_json": SELF_REQUIRED}, "guided_json"),
    ("/invocations", {"grammar": {"type": "json", "value": SELF_REQUIRED}},
     "parameters.grammar.value"),
])
def test_a_schema_that_requires_itself_is_a_400_naming_the_field(app, route, fields,
                                                                 field) -> None:
    r = ask(app[0], route, fields)
    assert r.status_code == 400, r.get_data()
    assert message(r).startswith(f"{field} matches no finite string")


@pytest.mark.parametrize(("route", "fields", "field"), [
    ("/invocations", {"guided_regex": EMPTY_REGEX}, "parameters.guided_regex"),
    ("/invocations", {"grammar": {"type": "regex", "value": EMPTY_REGEX}},
     "parameters.grammar.value"),
    ("/v1/completions", {"guided_regex": EMPTY_REGEX}, "guided_regex"),
    ("/v1/chat/completions", {"guided_grammar": f"start: /{EMPTY_REGEX}/"}, "guided_grammar"),
])
def test_an_empty_regex_is_a_400_not_an_empty_answer(app, route, fields, field) -> None:
    r = ask(app[0], route, fields)
    assert r.status_code == 400, r.get_data()
    assert message(r).startswith(f"{field} matches no finite string: no string matches it")


def test_a_grammar_failing_while_generating_is_a_logged_400(app, caplog, monkeypatch) -> None:
    """What the checks do not see (here the dry run is off; no static check reads schemas)
    ends its request with a 400 naming the field, logged, and frees its blocks."""
    monkeypatch.setattr(engine.guided, "DRY_RUN_TOKENS", 0)
    # its own schema: check() caches what it saw
    late = {"guided_json": {"type": "object", "properties": {"late": {"$ref": "#"}},
                            "required": ["late"]}}
    client, state = app
    with caplog.at_level(logging.WARNING, logger="engine"):
        r = ask(client, "/invocations", late, max_tokens=30)
    assert r.status_code == 400, r.get_data()
    assert message(r).startswith("parameters.guided_json failed while generating after")
    assert any("its grammar (parameters.guided_json) failed" in rec.getMessage()
               for rec in caplog.records)
    r = ask(client, "/v1/chat/completions", late, max_tokens=30)
    assert r.status_code == 400 and "guided_json failed while generating" in message(r)
    # streaming: the answer has begun (200); its last line is the error, with the 400's code
    r = ask(client, "/invocations", late, max_tokens=30, stream=True)
    last = json.loads(r.get_data().decode().strip().splitlines()[-1])
    assert last["code"] == 400 and "guided_json failed while generating" in last["message"]
    assert state.engine.gauges().kv_blocks_used == 0


def test_good_grammars_still_answer(app) -> None:
    client = app[0]
    for fields in ({"guided_grammar": 'start: "a"+ "!"'}, {"guided_regex": "[a-c]{2}"},
                   {"guided_choice": ["up", "down"]}, {"guided_json": SCHEMAS[4][0]},
                   {"guided_grammar": 'start: x\nx: "a" x | "b"'}):
        r = ask(client, "/v1/completions", fields, max_tokens=40)
        assert r.status_code == 200, (fields, r.get_data())


# Edge values per field: endless recursions, empty languages, contradictions, huge repeats,
# plus anything (json_values, words) so the field's own checks get their share.
GRAMMARS = st.one_of(st.sampled_from([
    ENDLESS, LATE, "start: start", "start: a\na: b\nb: a", 'start: x\nx: "a" x | "b"',
    f"start: /{EMPTY_REGEX}/", 'start: ""', 'start: "a"*', "start: %json {}",
    'start: %json {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}',
    "start: <|im_end|>", "start: <|nope|>", "", "start:", 'start: "a"{99999}', "start: /(/",
    'start: "a" | start start', 'start: ("a" | "b")+ "c"']), words, json_values)
REGEXES = st.one_of(st.sampled_from([
    EMPTY_REGEX, "(?!)", "a{0}", "", "a*", "x{1000000}", "(a|b)*c", r"\b", "^$", "[a-z]{3}",
    "[", "a{2,1}", r"[\s\S]*", "(a*)*b", "[^a]"]), words, json_values)
SCHEMA_EDGES = st.one_of(st.sampled_from([
    SELF_REQUIRED, {"$ref": "#/$defs/x", "$defs": {"x": {"$ref": "#/$defs/x"}}},
    {"type": "string", "minLength": 5, "maxLength": 2}, {"enum": []}, {"anyOf": []},
    {"type": "array", "minItems": 3, "maxItems": 1}, {"allOf": [{"type": "string"},
                                                                {"type": "integer"}]},
    {"type": "integer", "minimum": 5, "maximum": 1}, {"type": "array", "items": {"$ref": "#"},
                                                      "minItems": 1},
    True, False, {}, {"type": "object"}, {"type": "string", "pattern": EMPTY_REGEX},
    {"const": "x" * 300}]), st.sampled_from([s for s, _ in SCHEMAS]), json_values)
CHOICES = st.one_of(st.sampled_from([[], [""], ["a" * 2000], ["a", "a"], ["<|im_end|>"]]),
                    st.lists(words, max_size=3), json_values)
FIELDS = {
    "guided_grammar": GRAMMARS, "guided_regex": REGEXES, "guided_json": SCHEMA_EDGES,
    "guided_choice": CHOICES,
    "response_format": st.one_of(
        st.builds(lambda s: {"type": "json_schema", "json_schema": {"name": "f", "schema": s}},
                  SCHEMA_EDGES),
        st.sampled_from([{"type": "json_object"}, {"type": "text"}]), json_values),
    "grammar": st.one_of(
        st.builds(lambda s: {"type": "json", "value": s}, SCHEMA_EDGES),
        st.builds(lambda s: {"type": "regex", "value": s}, REGEXES), json_values)}


@FUZZ
@given(route=st.sampled_from(ROUTES), name=st.sampled_from(sorted(FIELDS)), data=st.data(),
       stream=st.booleans())
def test_any_guided_field_ends_in_200_or_4xx(app, route, name, data, stream) -> None:
    """TGI's `grammar` goes to /invocations, the others anywhere; a stream's last line is
    checked like a whole answer."""
    value = data.draw(FIELDS[name], label=name)
    r = ask(app[0], route, {name: value}, max_tokens=6, stream=stream)
    body = r.get_data()
    check_answer(r.status_code, body, r.headers.get("Content-Type", ""))
    if r.status_code == 200 and stream and route == "/invocations":
        last = json.loads(body.decode().strip().splitlines()[-1])
        assert last.get("code", 200) < 500, last
    elif r.status_code == 200 and stream:  # SSE: no line may carry a 5xx error
        assert b'"server_error"' not in body and b"InternalServerError" not in body, body


def test_healthy_after_fuzzing(app) -> None:
    client, state = app
    r = ask(client, "/invocations", {}, max_tokens=3)
    assert r.status_code == 200 and "generated_text" in r.get_json()
    assert state.engine.gauges().kv_blocks_used == 0
