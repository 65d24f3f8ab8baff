"""Build a ``loom.v1.Parameters`` message from flat keyword arguments.

Every option is named after its proto field (``max_new_tokens``, ``temperature``...), whichever
sub-message (``sampling``, ``stopping``, ``penalties``, ``response``, ``constraint``) holds it. An
option that is not passed, or passed as ``None``, is left unset, so the server applies its
default: ``optional`` proto fields keep "unset" distinct from zero, and sub-messages no option
touched stay absent. The constraint options (``json_schema``, ``json_object``, ``regex``,
``grammar``, ``choice``) are one field of a oneof: give at most one.

    >>> params = build_parameters(max_new_tokens=32, temperature=0.7)
    >>> params.stopping.max_new_tokens, params.HasField("penalties")
    (32, False)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

from .v1 import generation_pb2 as pb

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["PARAMETER_FIELDS", "ParameterOptions", "build_parameters"]


class ParameterOptions(TypedDict, total=False):
    """Every generation parameter, flat. See ``protos/loom/v1/generation.proto`` for meanings."""

    # Parameters.sampling
    do_sample: bool | None
    temperature: float | None
    top_k: int | None
    top_p: float | None
    typical_p: float | None
    min_p: float | None
    seed: int | None
    # Parameters.stopping
    max_new_tokens: int | None
    min_new_tokens: int | None
    stop_sequences: Sequence[str] | str | None
    stop_token_ids: Sequence[int] | None
    ignore_eos: bool | None
    include_stop_sequence: bool | None
    time_limit_ms: int | None
    # Parameters.penalties
    repetition_penalty: float | None
    frequency_penalty: float | None
    presence_penalty: float | None
    # Parameters.response
    tokens: bool | None
    logprobs: bool | None
    top_n_tokens: int | None
    prompt_logprobs: bool | None
    return_full_text: bool | None
    # Parameters itself
    truncate_input_tokens: int | None
    n: int | None
    best_of: int | None
    priority: int | None
    speculation: bool | None  # False: no drafts for this request when the server speculates
    # Parameters.constraint (structured output): at most one
    json_schema: str | Mapping[str, Any] | None  # a JSON text, or a mapping sent as JSON
    json_object: bool | None  # True: any JSON object
    regex: str | None
    grammar: str | None  # EBNF as xgrammar reads it; the start rule is `root`
    choice: Sequence[str] | None


# option name -> (sub-message field of Parameters, or None for Parameters itself; field name)
PARAMETER_FIELDS: Mapping[str, tuple[str | None, str]] = {
    **{
        name: ("sampling", name)
        for name in ("do_sample", "temperature", "top_k", "top_p", "typical_p", "min_p", "seed")
    },
    **{
        name: ("stopping", name)
        for name in (
            "max_new_tokens",
            "min_new_tokens",
            "stop_sequences",
            "stop_token_ids",
            "ignore_eos",
            "include_stop_sequence",
            "time_limit_ms",
        )
    },
    **{name: ("penalties", name) for name in ("repetition_penalty", "frequency_penalty", "presence_penalty")},
    **{
        name: ("response", name)
        for name in ("tokens", "logprobs", "top_n_tokens", "prompt_logprobs", "return_full_text")
    },
    **{name: (None, name) for name in ("truncate_input_tokens", "n", "best_of", "priority", "speculation")},
    **{name: ("constraint", name) for name in ("json_schema", "json_object", "regex", "grammar", "choice")},
}

_REPEATED = frozenset({"stop_sequences", "stop_token_ids"})


def build_parameters(
    base: pb.Parameters | None = None, /, **options: Unpack[ParameterOptions]
) -> pb.Parameters:
    """A new ``Parameters``: a copy of ``base`` (if given) with every non-``None`` option set.

    A repeated option (``stop_sequences``, ``stop_token_ids``) replaces the base's list; a single
    string is taken as one stop sequence. Raises ``TypeError`` for an unknown option name or a
    value of the wrong type, ``ValueError`` for a value out of the field's range.
    """
    params = pb.Parameters()
    if base is not None:
        params.CopyFrom(base)
    constraints = [name for name, value in options.items()
                   if PARAMETER_FIELDS.get(name, ("", ""))[0] == "constraint" and value not in (None, False)]
    if len(constraints) > 1:
        raise ValueError(f"give at most one constraint; got {', '.join(constraints)}")
    for name, value in options.items():
        _set_option(params, name, value)
    return params


def _set_constraint(constraint: pb.Constraint, name: str, value: Any) -> None:
    """One kind of the constraint oneof (setting it replaces any other kind the base had)."""
    if name == "json_object":
        if not isinstance(value, bool):
            raise TypeError(f"generation parameter 'json_object' takes a bool, not {value!r}")
        if value:
            constraint.json_object.SetInParent()
    elif name == "choice":
        if isinstance(value, str):
            raise TypeError("generation parameter 'choice' takes a sequence of strings, not one string")
        constraint.choice.SetInParent()
        del constraint.choice.choices[:]
        constraint.choice.choices.extend(value)
    elif name == "json_schema" and isinstance(value, Mapping):
        constraint.json_schema = json.dumps(value)
    else:
        setattr(constraint, name, value)


def _set_option(params: pb.Parameters, name: str, value: Any) -> None:
    try:
        group, field = PARAMETER_FIELDS[name]
    except KeyError:
        known = ", ".join(sorted(PARAMETER_FIELDS))
        raise TypeError(f"unknown generation parameter {name!r}; known: {known}") from None
    if value is None:
        return
    if group == "constraint":
        _set_constraint(params.constraint, name, value)
        return
    target: Any = params if group is None else getattr(params, group)
    if name in _REPEATED:
        values = [value] if isinstance(value, str) else list(value)
        container = getattr(target, field)
        if list(container) != values:  # an empty list over an empty field leaves presence alone
            del container[:]
            container.extend(values)
        return
    if isinstance(value, bool) and not isinstance(getattr(target, field), bool):
        raise TypeError(f"generation parameter {name!r} takes a number, not {value!r}")
    setattr(target, field, value)
