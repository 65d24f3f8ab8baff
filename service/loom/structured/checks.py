"""The front end's checks of a constraint, before the request is queued.

:class:`ConstraintChecker` knows, from start-up on, whether the model's vocabulary can be
described to xgrammar (if not, constrained requests are answered FAILED_PRECONDITION), and
finds what is wrong with one constraint: JSON that does not parse, schema keywords xgrammar
would ignore (:mod:`.schema_features`), and whatever xgrammar's parser refuses. Compiling (the
slow part) happens later, in the engine (:mod:`.compiler_pool`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .grammars import GrammarError, parse_json_schema, to_grammar
from .schema_features import unsupported_schema_features
from .spec import GrammarSpec
from .vocabulary import VocabularyError, describe_vocabulary


class ConstraintChecker:
    """``unavailable``: why structured output cannot be served on this model (None: it can)."""

    def __init__(self, unavailable: str | None = None) -> None:
        self.unavailable = unavailable

    @classmethod
    def for_tokenizer(cls, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> ConstraintChecker:
        """Describe the vocabulary once (about 0.25 s for 49k tokens) and remember the verdict."""
        try:
            describe_vocabulary(hf_tokenizer, vocab_size, eos_token_ids)
        except VocabularyError as exc:
            return cls(str(exc))
        except ImportError as exc:
            return cls(f"the xgrammar package cannot be imported: {exc}")
        return cls()

    def problems(self, spec: GrammarSpec) -> list[str]:
        """What is wrong with ``spec``, one sentence each (empty: it may be compiled)."""
        try:
            if spec.kind == "json_schema":
                schema = parse_json_schema(spec.text)
                if not isinstance(schema, (dict, bool)):
                    return [f"must be a JSON object (a schema), got a JSON {type(schema).__name__}"]
                found, count = unsupported_schema_features(schema)
                if found:
                    more = f" ({count} unsupported keywords in all)" if count > len(found) else ""
                    return [f"{p}{more if i == len(found) - 1 else ''}" for i, p in enumerate(found)]
            to_grammar(spec)
        except GrammarError as exc:
            return [str(exc)]
        return []
