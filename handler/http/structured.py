"""Structured-output fields of a request body → one GuidedSpec (engine/guided.py), checked.

OpenAI's `response_format` (json_object, json_schema), vLLM's `guided_json`, `guided_regex`,
`guided_choice` and `guided_grammar` (Lark, llguidance's dialect), and TGI's
`parameters.grammar` ({"type": "json" | "regex", "value": ...}). At most one per request."""

from __future__ import annotations

import json

from engine import GuidedSpec, RequestError, check_spec

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_FIELDS = (*GUIDED_FIELDS, "response_format")
_FORMATS = "text, json_object or json_schema"


def structured_spec(body: dict, prefix: str = "") -> GuidedSpec | None:
    """The body's one constraint (None: free text); RequestError naming the field when it is
    malformed, does not compile, or comes with another. `prefix` is how errors name the body's
    level (e.g. "parameters.")."""
    asked = [name for name in (*STRUCTURED_FIELDS, "grammar") if body.get(name) is not None]
    if len(asked) > 1:
        raise _bad(prefix + asked[1],
                   f"at most one of {', '.join(prefix + n for n in asked)} per request")
    if not asked:
        return None
    name = asked[0]
    spec = _spec(name, body[name], prefix + name)
    if spec is not None:
        check_spec(spec)
    return spec


def _spec(name: str, value: object, field: str) -> GuidedSpec | None:
    if name == "response_format":
        return _response_format(value, field)
    if name == "grammar":
        return _tgi_grammar(value, field)
    if name == "guided_json":
        return _schema(value, field)
    if name == "guided_choice":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise _bad(field, f"{field} must be a list of strings")
        return GuidedSpec.choice(value, field)
    if not isinstance(value, str) or not value:
        raise _bad(field, f"{field} must be a non-empty string")
    return GuidedSpec("regex" if name == "guided_regex" else "grammar", value, field)


def _schema(value: object, field: str) -> GuidedSpec:
    """A JSON schema given as an object (or a boolean), or as JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as err:
            raise _bad(field, f"{field} is not valid JSON (or nested too deeply)") from err
    if value is False:
        raise _bad(field, f"{field} is false: no answer could match it")
    if not isinstance(value, dict | bool):
        raise _bad(field, f"{field} must be a JSON schema (an object)")
    return GuidedSpec.json_schema({} if value is True else value, field)


def _response_format(value: object, field: str) -> GuidedSpec | None:
    """OpenAI's response_format: {"type": "text"}, {"type": "json_object"} or
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}."""
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object",
                                                                 "json_schema"):
        raise _bad(field, f"{field} must be an object whose type is {_FORMATS}")
    kind = value["type"]
    allowed = {"type"} | ({"json_schema"} if kind == "json_schema" else set())
    if set(value) - allowed:
        raise _bad(field, f"{field} of type {kind} takes only {', '.join(sorted(allowed))}")
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedSpec.json_schema({"type": "object"}, field)
    described = value.get("json_schema")
    if not isinstance(described, dict) or "schema" not in described or set(described) - {
            "name", "schema", "strict", "description"}:
        raise _bad(field, f"{field}.json_schema must be an object with schema (and name, "
                          "strict, description)")
    return _schema(described["schema"], f"{field}.json_schema.schema")


def _tgi_grammar(value: object, field: str) -> GuidedSpec:
    """TGI's parameters.grammar: {"type": "json", "value": schema} or {"type": "regex",
    "value": pattern}."""
    if not isinstance(value, dict) or set(value) != {"type", "value"} or value["type"] not in (
            "json", "regex"):
        raise _bad(field, f'{field} must be {{"type": "json" | "regex", "value": ...}}')
    if value["type"] == "json":
        return _schema(value["value"], f"{field}.value")
    if not isinstance(value["value"], str) or not value["value"]:
        raise _bad(field, f"{field}.value must be a non-empty regex string")
    return GuidedSpec("regex", value["value"], f"{field}.value")


def _bad(field: str, message: str) -> RequestError:
    return RequestError(message, field)
