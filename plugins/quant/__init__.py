"""Built-in weight quantizers.

``gguf``: a GGUF file's Q4_0 / Q4_1 / Q4_K / Q8_0 weights computed in their blocks on the CPU (the
default SmolLM2 ships as Q4_1). AWQ, GPTQ, FP8 and NF4 plug in the same way, here or from a
third-party package, through the ``loom_quantizers`` hook and the contract in
``loom.plugin_api.quantization`` (a config class that picks a linear method per layer).
"""

from __future__ import annotations

from collections.abc import Iterable

from loom.plugin_api import QuantizerSpec, hookimpl


def _load_gguf() -> type:
    from .gguf import GGUFConfig

    return GGUFConfig


def _check_gguf() -> str | None:
    from .gguf import cpu_unsupported_reason

    return cpu_unsupported_reason()


QUANTIZERS: list[QuantizerSpec] = [
    QuantizerSpec(
        name="gguf",
        summary="GGUF Q4_0/Q4_1/Q4_K/Q8_0 weights kept in their blocks, exact fp32 dequant in a CPU kernel (AVX2)",
        load=_load_gguf,
        check=_check_gguf,
    ),
]


@hookimpl
def loom_quantizers() -> Iterable[QuantizerSpec]:
    return list(QUANTIZERS)
