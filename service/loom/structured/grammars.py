"""A :class:`GrammarSpec` as xgrammar's ``Grammar``: the front end's syntax check and the compiler's input.

Building the ``Grammar`` parses the schema, regex or EBNF without the vocabulary: milliseconds
even for large schemas (the costly part, the token masks of every parser state, is the
compiler's). The front end builds it to refuse bad input before queueing; the engine's compile
workers build it again and compile it.

JSON is generated on one line with the separators ", " and ": " (``any_whitespace=False``): with
free whitespace a small model can emit newlines until max_new_tokens instead of closing the
object. Properties come in the schema's order, and, as with OpenAI's strict mode, an object has
only the properties its schema lists unless additionalProperties says otherwise.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .spec import GrammarSpec

if TYPE_CHECKING:
    import xgrammar

# xgrammar's errors start with "[hh:mm:ss] /path/to/file.cc:123: ": not for clients.
_LOG_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")
# Any JSON object, on one line, with any properties (strict mode off: none are listed).
_ANY_OBJECT_SCHEMA = '{"type": "object"}'


class GrammarError(ValueError):
    """The spec does not parse: the message says why, for the client."""


def clean_error(exc: BaseException) -> str:
    """xgrammar's message without its log prefix, on one line."""
    text = " ".join(str(exc).split())
    return _LOG_PREFIX.sub("", text) or type(exc).__name__


def to_grammar(spec: GrammarSpec) -> xgrammar.Grammar:
    """Parse ``spec`` (raises :class:`GrammarError`)."""
    import xgrammar as xg

    try:
        if spec.kind == "json_schema":
            return xg.Grammar.from_json_schema(spec.text, any_whitespace=False)
        if spec.kind == "json_object":
            return xg.Grammar.from_json_schema(_ANY_OBJECT_SCHEMA, any_whitespace=False, strict_mode=False)
        if spec.kind == "regex":
            return xg.Grammar.from_regex(spec.text)
        if spec.kind == "ebnf":
            return xg.Grammar.from_ebnf(spec.text, root_rule_name="root")
    except (RuntimeError, ValueError, TypeError) as exc:
        raise GrammarError(clean_error(exc)) from exc
    raise GrammarError(f"unknown constraint kind {spec.kind!r}")


def parse_json_schema(text: str) -> Any:
    """The schema as JSON (raises :class:`GrammarError`; a nesting too deep for the parser is one)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from exc
    except RecursionError as exc:
        raise GrammarError("not valid JSON: nested too deeply") from exc


def _ebnf_literal(text: str) -> str:
    """``text`` as an EBNF string literal: quotes, backslashes and control characters escaped,
    everything else as itself (xgrammar matches UTF-8)."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def choice_to_ebnf(choices: Sequence[str]) -> str:
    """A grammar whose only sentences are ``choices`` (each non-empty)."""
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)
