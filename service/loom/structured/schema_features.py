"""JSON Schema keywords xgrammar would silently ignore, found before a request is queued.

xgrammar turns a schema into a grammar and drops what it cannot express, at best with a warning
on the server's stderr: a client asking for ``multipleOf: 0.5`` would get ``0.3`` back and never
know. Loom refuses such a schema instead (INVALID_ARGUMENT naming the keyword and where it is).
The rules are xgrammar 0.2.8's, found by compiling schemas and feeding the matcher instances
that break one keyword: ``tests/unit/test_schema_features.py`` keeps both halves (each refused
keyword lets such an instance through; each accepted one stops it). They are:

- keywords it never enforces: uniqueItems, contains, minContains, maxContains, not,
  if/then/else, dependentRequired, dependentSchemas, dependencies, $dynamicRef, $recursiveRef;
- allOf with more than one schema; a $ref outside the schema;
- a schema that has $ref, const, enum, anyOf, oneOf or allOf is that keyword alone: any other
  constraint beside it is dropped (``type`` beside enum or const too, so an enum value of
  another type would be generated);
- without ``type``, number and string keywords (minimum, minLength, pattern...) are dropped;
- a pattern together with minLength or maxLength loses the lengths; multipleOf holds only for
  integers, with an integer step; string formats other than :data:`SUPPORTED_FORMATS`.

Annotations (title, description, default, examples, $comment, readOnly, deprecated, content*)
constrain nothing in JSON Schema 2020-12 and are accepted anywhere.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

# String formats xgrammar 0.2.8 turns into a grammar; any other is ignored by it.
SUPPORTED_FORMATS = frozenset({
    "date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
    "uri-reference", "uri-template", "uuid", "json-pointer", "relative-json-pointer",
})
# Keywords xgrammar ignores whatever their value (uniqueItems: only when true).
_IGNORED = {
    "contains": "contains is not enforced",
    "minContains": "minContains is not enforced",
    "maxContains": "maxContains is not enforced",
    "dependentRequired": "dependentRequired is not enforced",
    "dependentSchemas": "dependentSchemas is not enforced",
    "dependencies": "dependencies is not enforced",
    "not": "not is not enforced",
    "if": "if/then/else is not enforced",
    "$dynamicRef": "$dynamicRef is not supported",
    "$recursiveRef": "$recursiveRef is not supported",
}
# A schema with one of these is built from it alone.
_SELECTORS = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
# Keywords that constrain nothing (or only hold subschemas for $ref).
_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$comment", "readOnly", "writeOnly", "deprecated",
    "$schema", "$id", "$anchor", "$vocabulary", "contentEncoding", "contentMediaType", "contentSchema",
    "$defs", "definitions",
})
_NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_STRING_KEYWORDS = ("minLength", "maxLength", "pattern", "format")
_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}
# Where subschemas live: keyword -> how they are held.
_ONE = ("additionalProperties", "unevaluatedProperties", "propertyNames", "items", "additionalItems",
        "unevaluatedItems", "then", "else")
_MANY = ("prefixItems", "anyOf", "oneOf", "allOf")
_NAMED = ("properties", "patternProperties", "$defs", "definitions")


def _pointer(path: tuple[str, ...]) -> str:
    return "/" + "/".join(p.replace("~", "~0").replace("/", "~1") for p in path) if path else "/"


def _types(schema: dict[str, Any]) -> set[str] | None:
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    return None  # no type: any


def _subschemas(schema: dict[str, Any], path: tuple[str, ...]) -> Iterator[tuple[Any, tuple[str, ...]]]:
    for key in _ONE:
        if key in schema:
            value = schema[key]
            if key == "items" and isinstance(value, list):  # draft 7's tuple form
                yield from ((v, (*path, key, str(i))) for i, v in enumerate(value))
            elif key == "propertyNames" and isinstance(value, dict) and "type" not in value:
                yield {"type": "string", **value}, (*path, key)  # property names are strings
            else:
                yield value, (*path, key)
    for key in _MANY:
        if isinstance(schema.get(key), list):
            yield from ((v, (*path, key, str(i))) for i, v in enumerate(schema[key]))
    for key in _NAMED:
        if isinstance(schema.get(key), dict):
            yield from ((v, (*path, key, name)) for name, v in schema[key].items())


def _selector_problems(schema: dict[str, Any], selectors: list[str]) -> Iterator[str]:
    if len(selectors) > 1:
        yield f"{' and '.join(selectors)} in one schema: only one of them is enforced"
        return
    sel = selectors[0]
    besides = [k for k in schema if k != sel and k not in _ANNOTATIONS and k not in _IGNORED and k != "uniqueItems"
               and not (k == "type" and sel in ("enum", "const"))]
    if besides:
        yield (f"{', '.join(besides[:4])} beside {sel} {'is' if len(besides) == 1 else 'are'} not enforced "
               f"(the schema is {sel} alone): move {'it' if len(besides) == 1 else 'them'} into {sel}")
    types = _types(schema)
    if sel in ("enum", "const") and types is not None:
        values = schema["enum"] if sel == "enum" and isinstance(schema["enum"], list) else [schema.get(sel)]
        bad = [v for v in values if not any(_JSON_TYPES.get(t, lambda _: True)(v) for t in types)]
        if bad:
            yield (f"{sel} value {json.dumps(bad[0])[:40]} is not of type {'/'.join(sorted(types))}, and type is "
                   f"not enforced beside {sel}")
    if sel == "allOf" and isinstance(schema["allOf"], list) and len(schema["allOf"]) > 1:
        yield "allOf with more than one schema is not enforced"
    ref = schema.get("$ref")
    if sel == "$ref" and isinstance(ref, str) and not ref.startswith("#"):
        yield f"$ref {ref[:60]!r} points outside the schema (only local references like '#/$defs/x' resolve)"


def _problems_here(schema: dict[str, Any]) -> Iterator[str]:
    for key, why in _IGNORED.items():
        if key in schema:
            yield why
    if schema.get("uniqueItems") is True:
        yield "uniqueItems is not enforced"
    selectors = [k for k in _SELECTORS if k in schema]
    if selectors:
        yield from _selector_problems(schema, selectors)
        return
    types = _types(schema)
    if types is None:
        dropped = [k for k in (*_NUMBER_KEYWORDS, *_STRING_KEYWORDS) if k in schema]
        if dropped:
            yield f"{', '.join(dropped)} without a type {'is' if len(dropped) == 1 else 'are'} not enforced: add \"type\""
        return
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        yield "pattern together with minLength/maxLength: the length bounds would not be enforced"
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt not in SUPPORTED_FORMATS and "string" in types:
        yield f"format {fmt[:40]!r} is not enforced (supported: {', '.join(sorted(SUPPORTED_FORMATS))})"
    if "multipleOf" in schema:
        step = schema["multipleOf"]
        integral = isinstance(step, int) or (isinstance(step, float) and step.is_integer())
        if types != {"integer"} or not integral:
            yield "multipleOf is enforced only for an integer type with an integer step"


def unsupported_schema_features(schema: Any, limit: int = 5) -> tuple[list[str], int]:
    """The first ``limit`` problems of ``schema`` (each "where: what", where is a JSON pointer
    into the schema) and how many there are in all. Walks without recursion, so a deeply nested
    schema cannot exhaust the stack."""
    found: list[str] = []
    count = 0
    stack: list[tuple[Any, tuple[str, ...]]] = [(schema, ())]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue  # true / false schemas, or malformed parts xgrammar itself will reject
        for problem in _problems_here(node):
            count += 1
            if len(found) < limit:
                found.append(f"{_pointer(path)}: {problem}")
        stack.extend(reversed(list(_subschemas(node, path))))
    return found, count
