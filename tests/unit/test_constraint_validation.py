"""parameters.constraint through validation: each kind becomes the spec the engine compiles; bad
input is INVALID_ARGUMENT naming the field (and the keyword), before anything is queued; a model
whose vocabulary cannot be described is FAILED_PRECONDITION; the engine's refusals keep their
status."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from loom.engine.types import Rejection
from loom.frontend.completion import EngineRequestError
from loom.frontend.tokenizer import Tokenizer
from loom.server.errors import ServiceError, ValidationError
from loom.server.servicer import to_service_error
from loom.server.validation import RequestLimits, validate_generate
from loom.structured.checks import ConstraintChecker
from loom.structured.grammars import choice_to_ebnf
from loom.structured.spec import GrammarSpec
from loom_client.v1 import generation_pb2 as pb

LIMITS = RequestLimits(max_input_tokens=50, max_total_tokens=64, vocab_size=49152, default_max_new_tokens=20)
CHECKER = ConstraintChecker()
SCHEMA = json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}, "required": ["n"]})


@pytest.fixture(scope="module")
def tok(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(default_model_dir)


def plan_for(tok: Tokenizer, checker: ConstraintChecker | None = CHECKER, **constraint: Any) -> Any:
    req = pb.GenerateRequest(text="Hello", parameters=pb.Parameters(constraint=pb.Constraint(**constraint)))
    return validate_generate(req, "rid", tok, LIMITS, False, constraints=checker)


def refused(tok: Tokenizer, **constraint: Any) -> list[tuple[str, str]]:
    with pytest.raises(ValidationError) as info:
        plan_for(tok, **constraint)
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    return [(v.field, v.description) for v in info.value.violations]


@pytest.mark.parametrize(("constraint", "spec"), [
    ({"json_schema": SCHEMA}, GrammarSpec("json_schema", SCHEMA, "parameters.constraint.json_schema")),
    ({"json_object": pb.JsonObject()}, GrammarSpec("json_object", "", "parameters.constraint.json_object")),
    ({"regex": r"\d+"}, GrammarSpec("regex", r"\d+", "parameters.constraint.regex")),
    ({"grammar": 'root ::= "a" | "b"'}, GrammarSpec("ebnf", 'root ::= "a" | "b"', "parameters.constraint.grammar")),
    ({"choice": pb.Choice(choices=["yes", 'a "q"'])},
     GrammarSpec("ebnf", choice_to_ebnf(["yes", 'a "q"']), "parameters.constraint.choice")),
])
def test_each_kind_becomes_the_spec_the_engine_compiles(tok: Tokenizer, constraint: dict[str, Any],
                                                        spec: GrammarSpec) -> None:
    plan = plan_for(tok, **constraint)
    assert plan.engine_request.sampling.constraint == spec


def test_no_constraint_is_none(tok: Tokenizer) -> None:
    plan = validate_generate(pb.GenerateRequest(text="Hello"), "rid", tok, LIMITS, False, constraints=None)
    assert plan.engine_request.sampling.constraint is None


@pytest.mark.parametrize(("constraint", "field", "words"), [
    ({}, "parameters.constraint", "set exactly one of json_schema"),
    ({"json_schema": ""}, "parameters.constraint.json_schema", "must not be empty"),
    ({"json_schema": '{"type": "object",'}, "parameters.constraint.json_schema", "not valid JSON"),
    ({"json_schema": "[1, 2]"}, "parameters.constraint.json_schema", "must be a JSON object (a schema), got a JSON list"),
    ({"json_schema": '{"type": "number", "multipleOf": 0.5}'}, "parameters.constraint.json_schema",
     "/: multipleOf is enforced only for an integer type"),
    ({"json_schema": '{"type": "object", "properties": {"s": {"type": "string", "pattern": "a+", "minLength": 2}}}'},
     "parameters.constraint.json_schema", "/properties/s: pattern together with minLength"),
    ({"json_schema": '{"type": "string", "format": "color"}'}, "parameters.constraint.json_schema", "format 'color'"),
    ({"json_schema": '{"type": "mystery"}'}, "parameters.constraint.json_schema", 'Unsupported type "mystery"'),
    ({"json_schema": '{"$ref": "#/$defs/missing"}'}, "parameters.constraint.json_schema", "missing"),
    ({"regex": ""}, "parameters.constraint.regex", "must not be empty"),
    ({"regex": "(unclosed"}, "parameters.constraint.regex", "parenthesis is not closed"),
    ({"regex": r"\bword"}, "parameters.constraint.regex", "Word boundary is not supported"),
    ({"grammar": 'start ::= "a"'}, "parameters.constraint.grammar", 'root rule with name "root" is not found'),
    ({"grammar": 'root ::= "a" | undefined_rule'}, "parameters.constraint.grammar", "is not defined"),
    ({"choice": pb.Choice()}, "parameters.constraint.choice.choices", "at least one"),
    ({"choice": pb.Choice(choices=["a", "", ""])}, "parameters.constraint.choice.choices[1]",
     "must not be empty (2 empty ones in all)"),
])
def test_bad_constraints_name_their_field(tok: Tokenizer, constraint: dict[str, Any], field: str,
                                          words: str) -> None:
    violations = refused(tok, **constraint)
    assert violations[0][0] == field
    assert words in violations[0][1], violations
    assert "[" not in violations[0][1][:2] and ".cc:" not in violations[0][1]  # no xgrammar log prefix


def test_each_refused_keyword_is_its_own_violation(tok: Tokenizer) -> None:
    schema = {"type": "object", "properties": {
        "a": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        "b": {"type": "integer", "not": {"const": 1}}}}
    violations = refused(tok, json_schema=json.dumps(schema))
    assert violations == [
        ("parameters.constraint.json_schema", "/properties/a: uniqueItems is not enforced"),
        ("parameters.constraint.json_schema", "/properties/b: not is not enforced"),
    ]


def test_other_field_errors_come_with_the_constraint_shape_errors(tok: Tokenizer) -> None:
    req = pb.GenerateRequest(text="Hi", parameters=pb.Parameters(
        sampling=pb.SamplingParameters(top_p=2), constraint=pb.Constraint(regex="")))
    with pytest.raises(ValidationError) as info:
        validate_generate(req, "rid", tok, LIMITS, False, constraints=CHECKER)
    assert [v.field for v in info.value.violations] == ["parameters.sampling.top_p", "parameters.constraint.regex"]


def test_without_a_describable_vocabulary_constraints_are_failed_precondition(tok: Tokenizer) -> None:
    class NotATokenizer:
        pass

    broken = ConstraintChecker.for_tokenizer(NotATokenizer(), 49152, (2,))
    assert broken.unavailable is not None and "cannot describe" in broken.unavailable
    for checker in (broken, None):
        with pytest.raises(ServiceError) as info:
            plan_for(tok, checker, regex="a+")
        assert info.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.reason == "STRUCTURED_OUTPUT_UNAVAILABLE"
    # requests without a constraint are served as before
    assert validate_generate(pb.GenerateRequest(text="Hi"), "r", tok, LIMITS, False, constraints=broken)
    # SmolLM2's own vocabulary can be described
    assert ConstraintChecker.for_tokenizer(tok.hf_tokenizer, 49152, (2,)).unavailable is None


def _details(error: ServiceError) -> tuple[status_pb2.Status, list[Any]]:
    status = error.to_grpc_status()
    packed = status_pb2.Status.FromString(dict(status.trailing_metadata)["grpc-status-details-bin"])
    found = []
    for any_msg in packed.details:
        for cls in (error_details_pb2.BadRequest, error_details_pb2.ErrorInfo):
            if any_msg.Is(cls.DESCRIPTOR):
                msg = cls()
                any_msg.Unpack(msg)
                found.append(msg)
    return packed, found


def test_engine_refusals_keep_their_status_field_and_reason() -> None:
    timeout = EngineRequestError("the constraint did not compile within --grammar-compile-timeout (10 s)",
                                 Rejection("INVALID_ARGUMENT", "parameters.constraint.json_schema",
                                           "GRAMMAR_COMPILE_TIMEOUT"))
    error = to_service_error(timeout)
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    _, details = _details(error)
    bad = next(d for d in details if isinstance(d, error_details_pb2.BadRequest))
    info = next(d for d in details if isinstance(d, error_details_pb2.ErrorInfo))
    assert bad.field_violations[0].field == "parameters.constraint.json_schema"
    assert "--grammar-compile-timeout" in bad.field_violations[0].description
    assert info.reason == "GRAMMAR_COMPILE_TIMEOUT"
    vocab = to_service_error(EngineRequestError("no tokenizer", Rejection("FAILED_PRECONDITION", "f", "GRAMMAR_VOCABULARY")))
    assert vocab.code is grpc.StatusCode.FAILED_PRECONDITION and vocab.reason == "GRAMMAR_VOCABULARY"
    plain = to_service_error(EngineRequestError("model step failed"))
    assert plain.code is grpc.StatusCode.INTERNAL and plain.reason == "GENERATION_FAILED"
