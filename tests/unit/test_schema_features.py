"""The JSON Schema keywords Loom refuses are exactly ones xgrammar would let an output break.

Each case compiles the schema with xgrammar (a vocabulary of single ASCII characters, so any
text can be spelled) and feeds the matcher an instance that breaks one keyword. For a refused
keyword the matcher takes the bad instance (xgrammar ignores the keyword) and
``unsupported_schema_features`` names it; for an accepted one the matcher stops the bad
instance, takes a good one, and nothing is reported. A new xgrammar that starts (or stops)
enforcing a keyword fails here, and the list in loom.structured.schema_features follows it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from loom.structured.grammars import GrammarError, parse_json_schema, to_grammar
from loom.structured.schema_features import SUPPORTED_FORMATS, unsupported_schema_features
from loom.structured.spec import GrammarSpec

xg = pytest.importorskip("xgrammar")

OBJ_AB = {"a": {"type": "integer"}, "b": {"type": "integer"}}

# (schema, an instance that breaks the refused keyword, words the problem must contain)
REFUSED: list[tuple[dict[str, Any], str, str]] = [
    ({"type": "string", "pattern": "^[a-z]+$", "minLength": 3}, '"ab"', "minLength"),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 2}, '"abcd"', "maxLength"),
    ({"type": "string", "format": "idn-email"}, '"nobody"', "format 'idn-email'"),
    ({"type": "string", "format": "not-a-format"}, '"anything"', "format 'not-a-format'"),
    ({"type": "number", "multipleOf": 0.5}, "0.3", "multipleOf"),
    ({"type": "integer", "multipleOf": 2.5}, "3", "multipleOf"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]", "uniqueItems"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}, "[1, 2]", "contains"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}, "maxContains": 1}, "[3, 3]",
     "maxContains"),
    ({"type": "object", "properties": OBJ_AB, "dependentRequired": {"a": ["b"]}}, '{"a": 1}', "dependentRequired"),
    ({"type": "object", "properties": OBJ_AB, "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a": 1}',
     "dependentSchemas"),
    ({"type": "object", "properties": OBJ_AB, "dependencies": {"a": ["b"]}}, '{"a": 1}', "dependencies"),
    ({"type": "integer", "not": {"const": 3}}, "3", "not is"),
    ({"type": "integer", "if": {"minimum": 10}, "then": {"maximum": 5}}, "12", "if/then/else"),
    ({"allOf": [{"type": "integer", "minimum": 3}, {"type": "integer", "maximum": 5}]}, "9", "allOf with more"),
    ({"type": "integer", "allOf": [{"minimum": 3}]}, "1", "type beside allOf"),
    ({"type": "integer", "anyOf": [{"minimum": 3}]}, "1", "type beside anyOf"),
    ({"anyOf": [{"type": "integer"}, {"type": "string"}], "minimum": 3}, "1", "minimum beside anyOf"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "anyOf": [{"required": ["a"]}]}, "{}",
     "beside anyOf"),
    ({"$ref": "#/$defs/x", "maximum": 5, "$defs": {"x": {"type": "integer"}}}, "9", "maximum beside $ref"),
    ({"type": "integer", "enum": [1, 2, 30], "maximum": 5}, "30", "maximum beside enum"),
    ({"type": "string", "enum": [1, "a"]}, "1", "enum value 1 is not of type string"),
    ({"type": "integer", "const": "a"}, '"a"', 'const value "a"'),
    ({"minimum": 3}, "1", "minimum without a type"),
    ({"minLength": 3}, '"a"', "minLength without a type"),
    ({"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}, "required": ["a"]},
     '{"a": [true]}', "outside the schema"),
]

# (schema, an instance that breaks one of its keywords, an instance that keeps them all)
ACCEPTED: list[tuple[dict[str, Any], str, str]] = [
    ({"type": "string", "minLength": 3}, '"ab"', '"abc"'),
    ({"type": "string", "maxLength": 2}, '"abc"', '"ab"'),
    ({"type": "string", "pattern": "^[a-z]+$"}, '"a1"', '"ab"'),
    ({"type": "integer", "multipleOf": 3}, "4", "6"),
    ({"type": "integer", "minimum": 3}, "1", "3"),
    ({"type": "integer", "exclusiveMaximum": 3}, "3", "2"),
    ({"type": "number", "maximum": 3.5}, "4", "3.25"),
    ({"type": "number", "exclusiveMinimum": 1}, "1", "1.5"),
    ({"type": ["integer", "string"], "minimum": 3}, "1", "4"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, "[1]", "[1, 2]"),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 1}, "[1, 2]", "[1]"),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "string"}}, "[1, 2]", '[1, "x"]'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, "{}", '{"a": 1}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False}, '{"b": 1}',
     '{"a": 1}'),
    ({"type": "object", "minProperties": 1, "additionalProperties": {"type": "integer"}}, "{}", '{"k": 1}'),
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, '{"x": "s"}', '{"x": 1}'),
    ({"type": "object", "propertyNames": {"pattern": "^[a-z]$"}, "additionalProperties": {"type": "integer"}},
     '{"ab": 1}', '{"a": 1}'),
    ({"properties": {"a": {"type": "integer"}}, "required": ["a"]}, "{}", '{"a": 1}'),
    ({"allOf": [{"type": "integer", "minimum": 3}], "description": "one schema"}, "1", "3"),
    ({"anyOf": [{"type": "integer", "minimum": 3}, {"type": "boolean"}]}, "1", "true"),
    ({"oneOf": [{"type": "integer", "minimum": 3}, {"type": "null"}]}, "1", "null"),
    ({"enum": ["a", "b"], "title": "t"}, '"c"', '"b"'),
    ({"type": "integer", "enum": [1, 2]}, "3", "2"),
    ({"const": "a"}, '"b"', '"a"'),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "required": ["a"],
      "$defs": {"x": {"type": "integer", "minimum": 3}}}, '{"a": 1}', '{"a": 3}'),
]
_GOOD_FORMATS = {
    "date-time": ('"2020-13-45"', '"2020-01-02T03:04:05Z"'), "date": ('"20-1-1"', '"2020-01-02"'),
    "time": ('"25:99"', '"03:04:05Z"'), "duration": ('"5 days"', '"P5D"'), "email": ('"nobody"', '"a@b.io"'),
    "hostname": ('"-bad-"', '"example.com"'), "ipv4": ('"1.2.3"', '"1.2.3.4"'), "ipv6": ('"xyz"', '"::1"'),
    "uri": ('"no scheme"', '"https://a.io/x"'), "uri-reference": ('"a b c"', '"../x"'),
    "uri-template": ('"{unclosed"', '"/x/{id}"'), "uuid": ('"1234"', '"123e4567-e89b-12d3-a456-426614174000"'),
    "json-pointer": ('"x"', '"/a/0"'), "relative-json-pointer": ('"x"', '"0/a"'),
}
ACCEPTED += [({"type": "string", "format": f}, bad, good) for f, (bad, good) in _GOOD_FORMATS.items()]


@pytest.fixture(scope="module")
def compiler() -> Any:
    vocab = ["</s>"] + [chr(c) for c in range(32, 127)]  # any ASCII text, one character a token
    info = xg.TokenizerInfo(vocab, xg.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[0])
    return xg.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def matches(compiler: Any, schema: dict[str, Any], text: str) -> bool:
    compiled = compiler.compile_grammar(to_grammar(GrammarSpec("json_schema", json.dumps(schema))))
    matcher = xg.GrammarMatcher(compiled)
    return bool(matcher.accept_string(text) and matcher.is_completed())


@pytest.mark.parametrize(("schema", "bad", "words"), REFUSED, ids=[w for _, _, w in REFUSED])
def test_each_refused_keyword_is_one_xgrammar_ignores(compiler: Any, schema: dict[str, Any], bad: str,
                                                      words: str) -> None:
    assert matches(compiler, schema, bad), "xgrammar enforces this now: stop refusing it"
    found, count = unsupported_schema_features(schema)
    assert count >= 1 and any(words in p for p in found), found


@pytest.mark.parametrize(("schema", "bad", "good"), ACCEPTED, ids=[json.dumps(s)[:60] for s, _, _ in ACCEPTED])
def test_each_accepted_keyword_is_enforced(compiler: Any, schema: dict[str, Any], bad: str, good: str) -> None:
    assert unsupported_schema_features(schema) == ([], 0)
    assert not matches(compiler, schema, bad), "xgrammar lets this through: refuse the keyword"
    assert matches(compiler, schema, good)


def test_supported_formats_are_the_tested_ones() -> None:
    assert set(_GOOD_FORMATS) == SUPPORTED_FORMATS


def test_problems_name_where_they_are_and_count_past_the_limit() -> None:
    schema = {"type": "object", "properties": {
        "a/b": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        "tags": {"type": "array", "items": {"type": "number", "multipleOf": 0.1}},
        **{f"p{i}": {"type": "string", "format": "color"} for i in range(6)},
    }, "$defs": {"x": {"not": {}}}}
    found, count = unsupported_schema_features(schema)
    assert count == 9 and len(found) == 5
    assert found[0] == "/properties/a~1b: uniqueItems is not enforced"
    assert found[1] == "/properties/tags/items: multipleOf is enforced only for an integer type with an integer step"


def test_annotations_and_nesting_are_fine_and_deep_schemas_do_not_recurse() -> None:
    schema: dict[str, Any] = {"type": "integer", "title": "t", "description": "d", "default": 1, "examples": [2],
                              "$comment": "c", "deprecated": False, "readOnly": True}
    assert unsupported_schema_features(schema) == ([], 0)
    deep: dict[str, Any] = {"type": "integer", "multipleOf": 0.5}
    for _ in range(5000):  # deeper than Python's recursion limit
        deep = {"type": "array", "items": deep}
    found, count = unsupported_schema_features(deep)
    assert count == 1 and found[0].endswith("multipleOf is enforced only for an integer type with an integer step")
    with pytest.raises(GrammarError, match="nested too deeply"):
        parse_json_schema("[" * 100_000 + "]" * 100_000)
