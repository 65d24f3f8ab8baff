"""JSON Schema keywords xgrammar would silently ignore, found before a request is queued.

xgrammar turns a schema into a grammar, and drops what it cannot express, at best with a warning
on the server's stderr: a client asking for ``multipleOf: 0.5`` would get ``0.3`` back and never
know. Loom refuses such a schema instead (INVALID_ARGUMENT naming the keyword and where it is).
The list is xgrammar 0.2.8's, checked keyword by keyword against the grammar it produces
(``tests/unit/test_schema_features.py`` holds both halves: each keyword refused here is one
xgrammar ignores, and each one accepted changes the grammar).

Annotations (title, description, default, examples, $comment, readOnly, deprecated, content*)
constrain nothing in JSON Schema 2020-12 and are accepted.
"""

from __future__ import annotations

from collections.abc import Iterator
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
            else:
                yield value, (*path, key)
    for key in _MANY:
        if isinstance(schema.get(key), list):
            yield from ((v, (*path, key, str(i))) for i, v in enumerate(schema[key]))
    for key in _NAMED:
        if isinstance(schema.get(key), dict):
            yield from ((v, (*path, key, name)) for name, v in schema[key].items())


def _problems_here(schema: dict[str, Any]) -> Iterator[str]:
    types = _types(schema)
    for key, why in _IGNORED.items():
        if key in schema:
            yield why
    if schema.get("uniqueItems") is True:
        yield "uniqueItems is not enforced"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        yield "allOf with more than one schema is not enforced"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        yield f"$ref {ref[:60]!r} points outside the schema (only local references like '#/$defs/x' resolve)"
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        yield "pattern together with minLength/maxLength: the length bounds would not be enforced"
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt not in SUPPORTED_FORMATS and (types is None or "string" in types):
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
