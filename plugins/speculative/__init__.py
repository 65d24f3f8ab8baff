"""Built-in speculative decoders, registered through the ``loom`` entry-point group exactly as a
third-party package registers its own (``loom_speculative_decoders``).

- ``ngram``: prompt lookup, drafts copied from the sequence's own context (``ngram.py``).
- ``draft``: a small model with the same tokenizer drafts greedily (``draft_model.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

from loom.plugin_api import SpeculativeDecoderSpec, hookimpl, lazy_import

SPECULATIVE_DECODERS: list[SpeculativeDecoderSpec] = [
    SpeculativeDecoderSpec(
        name="ngram",
        summary="prompt lookup: drafts what followed the latest earlier occurrence of the last n tokens "
        "(options min_n, max_n)",
        load=lazy_import(__name__, ".ngram", "NgramProposer"),
    ),
    SpeculativeDecoderSpec(
        name="draft",
        summary="a draft model with the target's tokenizer guesses greedily on a worker of its own "
        "(options model_id, quantize, kv_tokens)",
        load=lazy_import(__name__, ".draft_model", "DraftModelProposer"),
    ),
]


@hookimpl
def loom_speculative_decoders() -> Iterable[SpeculativeDecoderSpec]:
    return list(SPECULATIVE_DECODERS)
