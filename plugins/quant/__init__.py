"""Built-in weight quantizers, registered through the ``loom`` entry-point group like any third-party one.

- ``gguf``: a GGUF file's Q4_0 / Q4_1 / Q4_K / Q8_0 weights computed in their blocks on the CPU
  (the default SmolLM2 ships as Q4_1);
- ``gptq``: GPTQ checkpoints (v1 "gptq" and ``gptq_v2``; 2/4/8 bits, any group size that tiles
  the input, act-order), or ``--quantize gptq`` on a random-weight model (benchmarks);
- ``awq``: AWQ GEMM checkpoints (4-bit with zero points);
- ``fp8``: FP8 e4m3 checkpoints (vLLM / compressed-tensors; per-tensor, per-channel or block-wise
  scales), or ``--quantize fp8`` while loading; Mixture-of-Experts experts too (``fp8_moe``);
- ``wna16``: compressed-tensors ``pack-quantized`` integer weights (LLM Compressor's W4A16 / W8A16);
- ``nf4``: bitsandbytes NF4 checkpoints (with or without double quantization), or ``--quantize
  nf4`` while loading.

Each is a config class that picks a linear method per layer (``loom.plugin_api.quantization``).
On CUDA, GPTQ, AWQ, wna16 and NF4 share one packed layout and Triton kernels (``w4a16_layout``,
``w4a16_triton``); FP8 runs ``torch._scaled_mm`` with a Triton activation quantizer
(``fp8_triton``). Elsewhere the layers dequantize per call (``dequant_linear``).
``loom quantize`` (``make/``) writes GPTQ, AWQ, RTN (GPTQ format), FP8 and NF4 checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterable

from loom.plugin_api import QuantizerSpec, hookimpl, lazy_call, lazy_import

QUANTIZERS: list[QuantizerSpec] = [
    QuantizerSpec(
        name="gguf",
        summary="GGUF Q4_0/Q4_1/Q4_K/Q8_0 weights kept in their blocks, exact fp32 dequant in a CPU kernel (AVX2)",
        load=lazy_import(__name__, ".gguf", "GGUFConfig"),
        check=lazy_call(__name__, ".gguf", "cpu_unsupported_reason"),
    ),
    QuantizerSpec(
        name="gptq",
        summary="GPTQ checkpoints (gptq v1 and gptq_v2, 2/4/8-bit, groups or per channel, act-order); Triton "
                "W4A16 GEMV / GEMM on CUDA, dequantized per layer on the CPU",
        load=lazy_import(__name__, ".gptq", "GPTQConfig"),
    ),
    QuantizerSpec(
        name="awq",
        summary="AWQ GEMM checkpoints (4-bit, zero points); repacked for the Triton W4A16 kernels on CUDA, "
                "dequantized per layer on the CPU",
        load=lazy_import(__name__, ".awq", "AWQConfig"),
    ),
    QuantizerSpec(
        name="fp8",
        summary="FP8 e4m3 checkpoints (vLLM fp8, compressed-tensors; per-tensor or per-channel scales, static or "
                "dynamic activations; block-wise scales, weight-only) or --quantize fp8 while loading, MoE "
                "experts included; torch._scaled_mm on CUDA (compute capability 8.9+), W8A8 emulated on the CPU",
        load=lazy_import(__name__, ".fp8", "FP8Config"),
        check=lazy_call(__name__, ".fp8", "unsupported_reason"),
    ),
    QuantizerSpec(
        name="wna16",
        summary="compressed-tensors pack-quantized integer weights (W4A16 / W8A16, groups or per channel, "
                "symmetric or not, act-order), as LLM Compressor writes them; the Triton W4A16 kernels on CUDA, "
                "dequantized per layer on the CPU",
        load=lazy_import(__name__, ".compressed_int", "WNA16Config"),
    ),
    QuantizerSpec(
        name="nf4",
        summary="bitsandbytes NF4 checkpoints (double quant or not) or --quantize nf4 while loading; Loom's Triton "
                "NF4 kernels on CUDA, dequantized per layer on the CPU (bitsandbytes not needed)",
        load=lazy_import(__name__, ".nf4", "NF4Config"),
    ),
]


@hookimpl
def loom_quantizers() -> Iterable[QuantizerSpec]:
    return list(QUANTIZERS)
