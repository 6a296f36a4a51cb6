"""A JSON value checked against a JSON schema written in a small subset of JSON Schema (KEYWORDS), strictly:
what the structured-output tests and bench/grammar.py check their answers with, independently of the
grammar engine that produced them (and without the jsonschema package, which the GPU machine lacks).
A schema using any other keyword is refused rather than half checked."""

from __future__ import annotations

import re

KEYWORDS = frozenset({"type", "properties", "required", "additionalProperties", "items", "maxItems", "enum",
                      "minimum", "maximum", "maxLength", "pattern"})
TYPES = {"object": dict, "array": list, "string": str, "boolean": bool}


def valid(value, schema: dict) -> bool:
    if unknown := set(schema) - KEYWORDS:
        raise ValueError(f"schema_check: keyword(s) {sorted(unknown)} not supported (supported: {sorted(KEYWORDS)})")
    kind = schema.get("type")
    if kind == "integer":
        if not isinstance(value, int) or isinstance(value, bool):
            return False
    elif kind is not None and kind not in TYPES:
        raise ValueError(f"schema_check: type {kind!r} not supported (supported: integer, {', '.join(TYPES)})")
    elif kind in TYPES and not isinstance(value, TYPES[kind]):
        return False
    if "enum" in schema and value not in schema["enum"]:
        return False
    if kind == "integer" and not schema.get("minimum", value) <= value <= schema.get("maximum", value):
        return False
    if kind == "string" and (len(value) > schema.get("maxLength", len(value))
                             or ("pattern" in schema and not re.search(schema["pattern"], value))):
        return False
    if kind == "array":
        return len(value) <= schema.get("maxItems", len(value)) and all(valid(v, schema["items"]) for v in value)
    if kind == "object":
        props = schema.get("properties", {})
        if any(k not in value for k in schema.get("required", [])):
            return False
        if schema.get("additionalProperties") is False and any(k not in props for k in value):
            return False
        return all(valid(v, props[k]) for k, v in value.items() if k in props)
    return True
