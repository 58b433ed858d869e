"""Twenty varied JSON schemas, each with a valid instance: the structured-output workload of
`bench grammar-masks` and `bench constrained`, and the schemas the OpenAI API tests validate.

Strings, arrays and numbers are bounded so that any model (a random one included) finishes an
answer within a few dozen tokens: the grammar, not the model, decides the length."""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 8}
SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 99}

SCHEMAS: list[tuple[dict, object]] = [
    ({"type": "object", "properties": {"name": NAME}, "required": ["name"],
      "additionalProperties": False}, {"name": "Ada"}),
    ({"type": "object", "properties": {"age": SMALL_INT}, "required": ["age"],
      "additionalProperties": False}, {"age": 36}),
    ({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
      "additionalProperties": False}, {"ok": True}),
    ({"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
      "required": ["color"], "additionalProperties": False}, {"color": "green"}),
    ({"type": "object", "properties": {"name": NAME, "age": SMALL_INT},
      "required": ["name", "age"], "additionalProperties": False}, {"name": "Bo", "age": 7}),
    ({"type": "array", "items": SMALL_INT, "minItems": 1, "maxItems": 3}, [1, 2]),
    ({"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4}, ["a", "c"]),
    ({"type": "object", "properties": {"point": {
        "type": "object", "properties": {"x": SMALL_INT, "y": SMALL_INT},
        "required": ["x", "y"], "additionalProperties": False}},
      "required": ["point"], "additionalProperties": False}, {"point": {"x": 1, "y": 2}}),
    ({"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}},
      "required": ["id"], "additionalProperties": False}, {"id": "AB123"}),
    ({"type": "object", "properties": {"kind": {"const": "fruit"}, "name": NAME},
      "required": ["kind", "name"], "additionalProperties": False},
     {"kind": "fruit", "name": "fig"}),
    ({"type": "object", "properties": {"value": {"anyOf": [SMALL_INT, {"type": "boolean"}]}},
      "required": ["value"], "additionalProperties": False}, {"value": False}),
    ({"type": "object", "properties": {"tags": {"type": "array", "items": NAME,
                                                "maxItems": 2}},
      "required": ["tags"], "additionalProperties": False}, {"tags": ["x"]}),
    ({"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 6}},
      "required": ["note"], "additionalProperties": False}, {"note": None}),
    ({"type": "object", "properties": {"score": {"type": "number", "minimum": 0,
                                                 "maximum": 1}},
      "required": ["score"], "additionalProperties": False}, {"score": 0.5}),
    ({"type": "object", "properties": {"user": {
        "type": "object", "properties": {"name": NAME, "admin": {"type": "boolean"}},
        "required": ["name", "admin"], "additionalProperties": False},
        "level": {"enum": [1, 2, 3]}}, "required": ["user", "level"],
      "additionalProperties": False}, {"user": {"name": "Cy", "admin": False}, "level": 2}),
    ({"type": "object", "properties": {"pairs": {
        "type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"k": NAME, "v": SMALL_INT},
            "required": ["k", "v"], "additionalProperties": False}}},
      "required": ["pairs"], "additionalProperties": False}, {"pairs": [{"k": "a", "v": 1}]}),
    ({"type": "object", "properties": {"date": {"type": "string",
                                                "pattern": "^2026-[01][0-9]-[0-3][0-9]$"}},
      "required": ["date"], "additionalProperties": False}, {"date": "2026-11-25"}),
    ({"enum": ["yes", "no", "maybe"]}, "maybe"),
    ({"type": "object", "properties": {"a": SMALL_INT, "b": SMALL_INT, "c": SMALL_INT},
      "required": ["a", "b", "c"], "additionalProperties": False}, {"a": 1, "b": 2, "c": 3}),
    ({"type": "object", "properties": {"matrix": {
        "type": "array", "maxItems": 2, "items": {"type": "array", "items": SMALL_INT,
                                                  "maxItems": 2}}},
      "required": ["matrix"], "additionalProperties": False}, {"matrix": [[1, 2], [3]]}),
]
