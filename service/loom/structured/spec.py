"""What a constrained request carries from the front end to the engine: a picklable spec."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# What the engine compiles. A choice list reaches the engine as the EBNF grammar it is
# equivalent to (see loom.structured.grammars.choice_to_ebnf).
GrammarKind = Literal["json_schema", "json_object", "regex", "ebnf"]


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint: its kind and text (empty for ``json_object``).

    ``field`` is the request field it came from ("parameters.constraint.json_schema"), so that an
    error found later (a compile that fails or runs past its time limit) names what the client
    sent. ``(kind, text)`` is the compile cache's key: the same text compiles once.
    """

    kind: GrammarKind
    text: str = ""
    field: str = "parameters.constraint"

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.text)
