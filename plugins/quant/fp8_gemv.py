"""FP8 weights at 1-4 rows: a weight-only GEMV (W8A16) instead of activation quantization + ``_scaled_mm``.

At a batch-1 decode the W8A8 path launches the per-token activation quantizer and then cuBLASLt's
e4m3 GEMM, which is poor at M = 1: llama-8b ran at 181 tok/s with FP8 weights against 205 in bf16
(docs/quantization.md, W6), when an e4m3 weight is half of bf16's bytes. Here the layer's e4m3
codes ``[N, K]`` go straight into :mod:`loom.layers.dense_gemv`'s kernel (its tiles, split-K and
fixed-order merges, shared rather than copied), which converts them in registers, multiplies the
bf16 / fp16 activations on the tensor cores with float32 accumulation and multiplies each output
channel's sums by its float32 weight scale once. No activation quantization, one launch (split-K
merged by the last split to arrive; by a second launch when its counters could not be allocated).

Numerics: W8A16, not W8A8. The activations are *not* rounded to e4m3, so at 1-4 rows a layer
computes ``x @ (codes * scale)^T`` (the dequantized weight, exactly) where 5 rows and more
compute ``fake_quantize(x) @ (codes * scale)^T`` (:func:`fp8.fake_quantize_activations`, which
the CPU path emulates). The GEMV is the more accurate of the two; tests hold it to the W8A16
reference (``tests/helpers/fp8_gemv_interpret_check.py``, ``tests/gpu/test_fp8_gemv_gpu.py``).

Batch invariance: the plan depends on ``(N, K)`` only and each output on its own row, so a
token's outputs are the same bits alone or with up to three other rows (bf16 activations: the
power of two that scales a row into fp16's range is the row's own). From 5 rows on the layer runs
W8A8, so a request's tokens can differ between a step of at most 4 rows and a larger one, by the
activation rounding (as a bf16 request's can between the dense GEMV and cuBLAS, and with
attention's split count): batch invariance holds within 1-4 rows and within 5+ rows, not across.

Plans: :data:`fp8_gemv_table.PLANS` (measured by ``scripts/bench_fp8_gemv.py`` on the GPU the
numbers are for), else :func:`default_plan`. Unlike the dense GEMV the rule serves every shape
before measurement: the path it replaces is known to be slow at these sizes.

Switches: ``LOOM_FP8_GEMV=0`` (:data:`loom.kernel_switches.fp8_gemv`) keeps W8A8 at every size;
``LOOM_FUSED_KERNELS=0`` turns every kernel off (the CPU emulation, W8A8, serves).
"""

from __future__ import annotations

import functools

import torch

from loom import kernel_switches
from loom.layers import dense_gemv as dg
from loom.layers.split_k import split_k

from . import fp8_gemv_table

MAX_M = dg.MAX_M  # the most token rows the GEMV serves


def default_plan(n: int, k: int, sms: int) -> dg.GemvPlan:
    """The rule before measurement: 64 x 256 tiles (256 bytes of each weight row an iteration, as
    the bf16 rule's 64 x 128), four warps, three stages, K split until about four programs an SM
    (at most 16 pieces), merged by the last split to arrive."""
    bn, bk = 64, 256
    split, _ = split_k(-(-n // bn), k, bk, 4 * sms, 16)
    return dg.GemvPlan(bn, bk, split, 4, 3, fused_reduce=split > 1)


def table_plan(n: int, k: int, m: int, sms: int) -> dg.GemvPlan | None:
    """The measured plan of an ``n x k`` FP8 layer at ``m`` rows on ``sms`` SMs; the rule's when the
    table has no entry; None (W8A8) when the entry serves fewer rows than ``m``."""
    entry = fp8_gemv_table.PLANS.get((sms, n, k))
    if entry is None:
        return default_plan(n, k, sms) if m <= MAX_M else None
    if m > entry[0]:
        return None
    _, bn, bk, split, warps, stages, fused = entry
    return dg.GemvPlan(bn, bk, split, warps, stages, fused)


@functools.cache
def _sm_count(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def plan_for(x: torch.Tensor, weight: torch.Tensor) -> dg.GemvPlan | None:
    """The plan that serves ``x @ W^T`` for an e4m3 ``weight [N, K]`` on the GEMV, or None (W8A8):
    CUDA, Triton, bf16 / fp16 activations, 1-4 rows, the switches on."""
    k = weight.shape[-1]
    if not x.is_cuda or x.shape[-1] != k:
        return None
    return plan_for_rows(weight, x.numel() // k if x.numel() else 0, x.dtype)


def plan_for_rows(weight: torch.Tensor, rows: int, dtype: torch.dtype) -> dg.GemvPlan | None:
    """:func:`plan_for` by the number of rows and their dtype (``weight`` on the GPU): what a
    producer of the layer's input asks before making it (``loom.layers.quantized_input``)."""
    if not (kernel_switches.fp8_gemv and kernel_switches.fused_kernels and dg.HAS_TRITON and weight.is_cuda):
        return None
    if dtype not in (torch.bfloat16, torch.float16) or weight.dim() != 2 or weight.stride(1) != 1:
        return None
    if not 0 < rows <= MAX_M:
        return None
    n, k = weight.shape
    index = weight.device.index if weight.device.index is not None else torch.cuda.current_device()
    return table_plan(n, k, rows, _sm_count(index))


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
             plan: dg.GemvPlan) -> torch.Tensor:
    """``x [..., K] @ (weight * scale[:, None])^T (+ bias)`` in ``x``'s dtype: ``weight [N, K]``
    float8_e4m3fn codes, ``scale`` float32 ``[N]`` (one per output channel), 1-4 rows of x."""
    return dg.dense_gemv(x, weight, bias, plan, scale=scale)


def layer_warm_up_token_counts(layer: object, max_tokens: int) -> tuple[int, ...]:
    """A ``DequantLinearMethod`` warm-up: the GEMV compiles one variant for 1 row (Triton
    specialises an integer argument equal to 1) and one for 2-4 (its other arguments are the
    layer's own), so counts 1 and 2 compile every variant; none when the layer was not prepared
    for CUDA or the GEMV is switched off."""
    state = getattr(layer, "__dict__", {}).get("fp8_gpu")
    if state is None or not (kernel_switches.fp8_gemv and kernel_switches.fused_kernels and dg.HAS_TRITON):
        return ()
    return tuple(c for c in (1, 2) if c <= max_tokens)


def maybe_fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor | None:
    """The GEMV's result when :func:`plan_for` picks it, else None (the caller's W8A8 path)."""
    plan = plan_for(x, weight)
    return None if plan is None else fp8_gemv(x, weight, scale, bias, plan)


# ---- block-wise FP8 (one scale per block of bn rows x bk inputs: Qwen3's and DeepSeek's FP8) ----


@functools.cache
def block_plan(n: int, k: int, block: tuple[int, int], sms: int) -> dg.GemvPlan:
    """The rule for a block-scaled layer: :func:`default_plan`'s 64-row tiles and split target,
    with K tiles that lie within one scale block (the largest power of two up to 256 that divides
    bk: ``dense_gemv.tile_within_block``) and the split counted in whole blocks."""
    split, _ = split_k(-(-n // 64), k, block[1], 4 * sms, 16)
    return dg.GemvPlan(64, dg.tile_within_block(256, block[1]), split, 4, 3, fused_reduce=split > 1)


def block_plan_for(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int]) -> dg.GemvPlan | None:
    """The plan that serves ``x`` on a block-scaled e4m3 ``weight [N, K]``, or None (the layer's
    dequantizing path): CUDA, Triton, bf16 / fp16 activations, 1-4 rows, bk a multiple of 16,
    the switches on (``LOOM_FP8_GEMV=0`` turns it off with the per-channel GEMV)."""
    if not (kernel_switches.fp8_gemv and kernel_switches.fused_kernels and dg.HAS_TRITON and x.is_cuda
            and weight.is_cuda) or block[1] % 16:
        return None
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dim() != 2 or weight.stride(1) != 1:
        return None
    n, k = weight.shape
    if x.shape[-1] != k or not 0 < x.numel() // k <= MAX_M:
        return None
    index = weight.device.index if weight.device.index is not None else torch.cuda.current_device()
    return block_plan(n, k, block, _sm_count(index))


def maybe_fp8_block_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                         bias: torch.Tensor | None) -> torch.Tensor | None:
    """``x @ (codes * scale[row // bn, col // bk])^T (+ bias)`` on the GEMV when
    :func:`block_plan_for` picks it, else None."""
    plan = block_plan_for(x, weight, block)
    return None if plan is None else dg.dense_gemv(x, weight, bias, plan, scale=scale, scale_block=block)
