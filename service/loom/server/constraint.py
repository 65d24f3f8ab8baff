"""``parameters.constraint`` -> a :class:`GrammarSpec`, or the violations that name its field.

Every problem is found before the request is queued: an empty text, an empty choice, JSON that
does not parse, a schema keyword the server cannot enforce, a regex or grammar xgrammar refuses
(INVALID_ARGUMENT, the field being e.g. ``parameters.constraint.json_schema``); a model whose
vocabulary xgrammar cannot describe (FAILED_PRECONDITION). Only a compile that runs past
``--grammar-compile-timeout`` is found later, by the engine.
"""

from __future__ import annotations

from loom.structured.checks import ConstraintChecker
from loom.structured.grammars import choice_to_ebnf
from loom.structured.spec import GrammarSpec
from loom_client.v1 import generation_pb2 as pb

from .errors import FieldViolation, failed_precondition, in_all

FIELD = "parameters.constraint"
KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


def read_constraint(params: pb.Parameters) -> tuple[GrammarSpec | None, list[FieldViolation]]:
    """The request's constraint as the engine compiles it (None when there is none), with the
    violations its shape alone shows (nothing parsed yet)."""
    if not params.HasField("constraint"):
        return None, []
    c = params.constraint
    kind = c.WhichOneof("kind")
    if kind is None:
        return None, [FieldViolation(FIELD, f"set exactly one of {', '.join(KINDS)}")]
    field = f"{FIELD}.{kind}"
    if kind == "json_object":
        return GrammarSpec("json_object", "", field), []
    if kind == "choice":
        choices = list(c.choice.choices)
        if not choices:
            return None, [FieldViolation(f"{field}.choices", "must hold at least one string")]
        empty = [i for i, text in enumerate(choices) if not text]
        if empty:
            return None, [FieldViolation(f"{field}.choices[{empty[0]}]",
                                         "must not be empty" + in_all(len(empty), "empty ones"))]
        return GrammarSpec("ebnf", choice_to_ebnf(choices), field), []
    text = getattr(c, kind)
    if not text:
        return None, [FieldViolation(field, "must not be empty")]
    return GrammarSpec("ebnf" if kind == "grammar" else kind, text, field), []


def check_constraint(spec: GrammarSpec, checker: ConstraintChecker | None) -> list[FieldViolation]:
    """INVALID_ARGUMENT violations of a constraint; raises FAILED_PRECONDITION when the model
    cannot serve one at all."""
    if checker is None:
        raise failed_precondition("structured output is not available on this server", "STRUCTURED_OUTPUT_UNAVAILABLE")
    problems = checker.problems(spec)
    if not problems and checker.unavailable is not None:
        raise failed_precondition(f"structured output is not available for this model: {checker.unavailable}",
                                  "GRAMMAR_VOCABULARY")
    return [FieldViolation(spec.field, p) for p in problems]
