"""Built-in speculative decoders, registered through the ``loom`` entry-point group exactly as a
third-party package registers its own (``loom_speculative_decoders``).

- ``ngram``: prompt lookup, drafts copied from the sequence's own context (``ngram.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from loom.plugin_api import SpeculativeDecoderSpec, hookimpl


def _load_ngram() -> Any:
    from .ngram import NgramProposer

    return NgramProposer


SPECULATIVE_DECODERS: list[SpeculativeDecoderSpec] = [
    SpeculativeDecoderSpec(
        name="ngram",
        summary="prompt lookup: drafts what followed the latest earlier occurrence of the last n tokens "
        "(options min_n, max_n)",
        load=_load_ngram,
    ),
]


@hookimpl
def loom_speculative_decoders() -> Iterable[SpeculativeDecoderSpec]:
    return list(SPECULATIVE_DECODERS)
