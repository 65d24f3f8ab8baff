"""Built-in speculative decoders.

None ships yet: the ``loom_speculative_decoders`` hook is in place so an n-gram (prompt lookup)
or draft-model proposer can be added here or by a third-party package.
"""

from __future__ import annotations

from collections.abc import Iterable

from loom.plugin_api import SpeculativeDecoderSpec, hookimpl

SPECULATIVE_DECODERS: list[SpeculativeDecoderSpec] = []


@hookimpl
def loom_speculative_decoders() -> Iterable[SpeculativeDecoderSpec]:
    return list(SPECULATIVE_DECODERS)
