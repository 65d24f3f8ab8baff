"""Built-in speculative decoders, registered through the ``loom`` entry-point group exactly as a
third-party package registers its own (``loom_speculative_decoders``).

- ``ngram``: prompt lookup, drafts copied from the sequence's own context (``ngram.py``).
- ``draft``: a small model with the same tokenizer drafts greedily (``draft_model.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from loom.plugin_api import SpeculativeDecoderSpec, hookimpl


def _load_ngram() -> Any:
    from .ngram import NgramProposer

    return NgramProposer


def _load_draft() -> Any:
    from .draft_model import DraftModelProposer

    return DraftModelProposer


SPECULATIVE_DECODERS: list[SpeculativeDecoderSpec] = [
    SpeculativeDecoderSpec(
        name="ngram",
        summary="prompt lookup: drafts what followed the latest earlier occurrence of the last n tokens "
        "(options min_n, max_n)",
        load=_load_ngram,
    ),
    SpeculativeDecoderSpec(
        name="draft",
        summary="a draft model with the target's tokenizer guesses greedily on a worker of its own "
        "(options model_id, quantize, kv_tokens)",
        load=_load_draft,
    ),
]


@hookimpl
def loom_speculative_decoders() -> Iterable[SpeculativeDecoderSpec]:
    return list(SPECULATIVE_DECODERS)
