"""Built-in weight quantizers.

None ships yet: the ``loom_quantizers`` hook and :class:`~loom.plugin_api.QuantizerSpec` are in
place so AWQ, GPTQ, FP8 and NF4 can be added here (or by a third-party package) without
touching the engine. An empty list is the honest answer until one is implemented.
"""

from __future__ import annotations

from collections.abc import Iterable

from loom.plugin_api import QuantizerSpec, hookimpl

QUANTIZERS: list[QuantizerSpec] = []


@hookimpl
def loom_quantizers() -> Iterable[QuantizerSpec]:
    return list(QUANTIZERS)
