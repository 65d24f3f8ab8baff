"""Triton kernels over the packed layout of ``w4a16_layout``: GPTQ and AWQ (integer codes with
zero points) and NF4 (a 16-value table) in one family, chosen by the number of tokens M:

- M = 1 (a decode step of one sequence): a GEMV. Each program dequantizes a ``[BLOCK_K,
  BLOCK_N]`` tile of ``W^T`` to float32 in registers and accumulates ``w * x`` elementwise,
  summing over K once at the end: no tensor cores, no shared-memory round trip, so the time is
  the time to read the packed weights.
- 1 < M < ``DENSE_FROM_TOKENS``: a tiled GEMM with the tile dequantized to the activations'
  dtype (float32 accumulation). 16-bit activations take the transposed form
  (:func:`_gemm_t_kernel`: ``W x^T``, the dequantized tile the tensor cores' register operand
  and the tokens their N; 4-bit integer codes dequantized two to a 32-bit operation,
  :func:`_int_tile_t_x2`); float32 activations the plain one (``x W^T``).
- M >= ``DENSE_FROM_TOKENS`` (129 by default: large decode batches and prefill): one kernel
  dequantizes the whole weight to a dense ``W^T [K, N]`` and cuBLAS multiplies. On the H200 at
  256 tokens that is 1.1x faster than the best fused plan over llama-8b's layers, while up to
  128 tokens the transposed GEMM is 1.3x faster than it (docs/quantization.md, "W2").

Both fused kernels split K over programs when the output alone would not give the GPU enough
of them (M small; targets: 8 GEMV or 4 GEMM programs an SM): each split writes float32 partial
sums, and a second kernel adds them in a fixed order, adds the bias and casts (deterministic, no
atomics).

Every launch depends only on shapes (the plan is a function of M, N, K and the group size):
no host synchronisation and no allocation that depends on data, so the kernels run inside CUDA
graphs. Act-order layers read ``x[:, perm]`` while loading the activations.

Accuracy: the weight is ``(q - zero) * scale`` (or ``table[q] * scale``) in float32 from
scales stored in the activations' dtype. The GEMV multiplies in float32; the GEMM rounds the
dequantized tile to the activations' dtype first (as the dense path does); both accumulate in
float32 and round the output once. ``tests/gpu/test_quant_kernels_gpu.py`` states the bound.

Triton is optional: without it this module imports and :func:`available` is False.
"""

# mypy: disable-error-code="no-untyped-def"
# (Triton kernels take untyped pointer arguments; annotations there would change their meaning.)
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch

from loom import kernel_switches
from loom.layers.split_k import split_k
from loom.layers.split_k import split_sum_kernel as _split_sum_kernel
from loom.layers.split_k import store_gemv as _store_gemv
from loom.layers.triton_jit import interpreting, pdl_launch, pdl_prologue
from loom.layers.triton_jit import jit as _jit

from .w4a16_layout import Segment, W4A16Layout

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

# At and above this many tokens a layer dequantizes its weight once and cuBLAS multiplies (the
# H200 sweep of bench/results/gpu-w4a16-plans-m96-256.json: over llama-8b's four layers 328 us
# at 256 tokens against 355 for the best fused plan; 331 at 128 against the transposed GEMM's
# 247). Overridable for tuning on a given GPU (LOOM_W4A16_DENSE_FROM=1024 ...); read at import.
DENSE_FROM_TOKENS = int(os.environ.get("LOOM_W4A16_DENSE_FROM", "129"))
# Split K until the grid holds this many programs per SM (or a split has one K block left): the
# GEMV's programs are small (a 128 x 64 tile), and a batch-1 decode needs many loads in flight.
# The GEMV's numbers are the H200 sweep's (scripts/bench_w4a16_plans.py, llama-8b's four layer
# shapes at M = 1, bench/results/gpu-w4a16-plans-m1.json): 128-wide tiles, 64-deep, two
# stages, about 5 programs an SM, up to 32 splits (down_proj's long K) were within 2% of the
# best plan of each shape and 1.22-1.43x faster than the 64-wide, 8-per-SM rule before.
# LOOM_W4A16_GEMM_T=0 keeps 2+ token calls on the plain tiled GEMM (_gemm_kernel) instead of the
# transposed one (_gemm_t_kernel), for side-by-side benchmarks; read once at import
GEMM_T = os.environ.get("LOOM_W4A16_GEMM_T", "1") != "0"
# LOOM_W4A16_PACKED_SPLIT_CAP=0 drops the packed tile's cap on the transposed GEMM's K splits
# from 128 tokens (see _gemm_t_plan), for side-by-side benchmarks; read once at import
PACKED_SPLIT_CAP = os.environ.get("LOOM_W4A16_PACKED_SPLIT_CAP", "1") != "0"
_PROGRAMS_PER_SM = {"gemv": 5, "gemm": 4}
_MAX_SPLIT = {"gemv": 32, "gemm": 16}


def available() -> bool:
    return HAS_TRITON


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------


@_jit
def _word_tile(qw_ptr, k0, offs_n, n_mask, K, stride_qk, F: tl.constexpr, WORDS: tl.constexpr,
               EVEN_K: tl.constexpr = False):
    """The packed words of ``W^T[k0 : k0 + WORDS * F, offs_n]``: ``[WORDS, BLOCK_N]`` int32, 0
    past N (and past K unless ``EVEN_K``: K is whole tiles)."""
    rows = k0 // F + tl.arange(0, WORDS)
    if EVEN_K:
        return tl.load(qw_ptr + rows[:, None] * stride_qk + offs_n[None, :], mask=n_mask[None, :], other=0)
    return tl.load(qw_ptr + rows[:, None] * stride_qk + offs_n[None, :],
                   mask=(rows < K // F)[:, None] & n_mask[None, :], other=0)


@_jit
def _weight_tile(qw_ptr, s_ptr, z_ptr, lut_ptr, k0, offs_n, n_mask, K, stride_qk, stride_sk,
                 GROUP: tl.constexpr, BITS: tl.constexpr, F: tl.constexpr, LUT: tl.constexpr,
                 ONE_GROUP: tl.constexpr, BLOCK_K: tl.constexpr, WORDS: tl.constexpr, BLOCK_N: tl.constexpr):
    """``W^T[k0 : k0 + BLOCK_K, offs_n]`` as float32 (0 past K or N). k0 is a multiple of BLOCK_K;
    ``F = 32 / BITS`` codes a word, ``WORDS = BLOCK_K / F`` word rows a tile, ``ONE_GROUP``:
    ``GROUP % BLOCK_K == 0`` (constants the launcher derives: Triton's interpreter cannot)."""
    words = _word_tile(qw_ptr, k0, offs_n, n_mask, K, stride_qk, F, WORDS)  # [BLOCK_K / F, BLOCK_N]
    shifts = tl.arange(0, F) * BITS
    # input r*F + j of a column sits in bits j*BITS of word r (an arithmetic shift, then the mask)
    q = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)  # [BLOCK_K / F, F, BLOCK_N]
    q = tl.reshape(q, (BLOCK_K, BLOCK_N))
    if ONE_GROUP:  # the tile lies in one group: one row of scales (and zeros)
        g = k0 // GROUP
        s = tl.load(s_ptr + g * stride_sk + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if LUT:
            v = tl.load(lut_ptr + q)
        else:
            z = tl.load(z_ptr + g * stride_sk + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            v = q.to(tl.float32) - z
    else:  # groups smaller than the tile (or not aligned to it): each input's own group
        offs_k = k0 + tl.arange(0, BLOCK_K)
        g2 = (offs_k // GROUP)[:, None] * stride_sk + offs_n[None, :]
        mask = (offs_k < K)[:, None] & n_mask[None, :]
        s = tl.load(s_ptr + g2, mask=mask, other=0.0).to(tl.float32)
        if LUT:
            v = tl.load(lut_ptr + q)
        else:
            v = q.to(tl.float32) - tl.load(z_ptr + g2, mask=mask, other=0.0).to(tl.float32)
    return v * s


@_jit
def _gemv_kernel(x_ptr, perm_ptr, qw_ptr, s_ptr, z_ptr, lut_ptr, bias_ptr, out_ptr,
                 N, K, K_SPLIT, stride_qk, stride_sk, stride_os,
                 GROUP: tl.constexpr, BITS: tl.constexpr, F: tl.constexpr, LUT: tl.constexpr,
                 ONE_GROUP: tl.constexpr, WORDS: tl.constexpr, HAS_PERM: tl.constexpr,
                 HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 USE_PDL: tl.constexpr = False):
    # One program: BLOCK_N outputs of the one token, over K_SPLIT inputs (split pid_s).
    if USE_PDL:  # x comes from the kernel before
        pdl_prologue()
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    k_start = pid_s * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        if HAS_PERM:  # noqa: SIM108 (a constexpr branch, kept as a plain if for Triton)
            src = tl.load(perm_ptr + offs_k, mask=k_mask, other=0)
        else:
            src = offs_k
        x = tl.load(x_ptr + src, mask=k_mask, other=0.0).to(tl.float32)
        w = _weight_tile(qw_ptr, s_ptr, z_ptr, lut_ptr, k0, offs_n, n_mask, K, stride_qk, stride_sk,
                         GROUP, BITS, F, LUT, ONE_GROUP, BLOCK_K, WORDS, BLOCK_N)
        acc += w * x[:, None]
    _store_gemv(tl.sum(acc, axis=0), out_ptr, offs_n, n_mask, bias_ptr, offs_n, n_mask, pid_s, stride_os, HAS_BIAS,
                PARTIAL)


@_jit
def _gemv_int_kernel(x_ptr, perm_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr,
                     N, K, K_SPLIT, stride_qk, stride_sk, stride_os, MAGIC, HI_SHIFT,
                     GROUP: tl.constexpr, BITS: tl.constexpr, F: tl.constexpr, WORDS: tl.constexpr,
                     HAS_PERM: tl.constexpr, EVEN_K: tl.constexpr, X_PAIRS: tl.constexpr,
                     HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False):
    """The one-token GEMV for integer codes whose K tiles lie in one group (``GROUP % BLOCK_K
    == 0``), written for the ALU: about 3 instructions a weight, where :func:`_gemv_kernel`'s
    unpack-convert-scale spends about 13 and runs at a third of the read bandwidth.

    - No integer-to-float conversion. Code j of a word sits at bit ``b = BITS * (j % HALF)`` of
      the word (the low half-word) or of the word shifted right by 16 (the high one). Masked in
      place and ORed with the exponent ``23 - b`` it *is* the float ``2^(23-b) + q`` (its
      float's mantissa unit is ``2^-b`` there: ``2^(23-b) * (1 + q 2^b / 2^23)``): one LOP3.
      One FADD takes ``2^(23-b) + zero`` off, exactly, leaving ``q - zero``.
    - The scale is applied once per word row: ``t`` sums ``(q - zero) * x`` over a row's F codes
      (one FFMA each), then ``acc += t * scale``.
    - ``MAGIC`` (``0x4B000000``, the float 2^23) and ``HI_SHIFT`` (16) arrive as run-time
      arguments: as constants, LLVM folds the mask and the OR into two instructions (LOP3 takes
      one immediate) and the shift and mask into a bit-field extract.
    - bf16 activations are read two at a time as one int32 (``X_PAIRS``): a bf16 is the top half
      of its float32, so either half becomes a float with one shift or mask.

    ``scripts/w4a16_sass.py`` counts the instructions of the compiled loop (sm_90, no GPU)."""
    if USE_PDL:  # x comes from the kernel before
        pdl_prologue()
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    HALF: tl.constexpr = 16 // BITS  # codes in a word's low half
    MASK: tl.constexpr = (1 << BITS) - 1
    acc = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
    k_start = pid_s * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    x_pairs = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    for k0 in range(k_start, k_end, BLOCK_K):
        rows = k0 // F + tl.arange(0, WORDS)  # word rows of the tile
        r_mask = rows < K // F
        if EVEN_K:
            words = tl.load(qw_ptr + rows[:, None] * stride_qk + offs_n[None, :], mask=n_mask[None, :], other=0)
        else:
            words = tl.load(qw_ptr + rows[:, None] * stride_qk + offs_n[None, :],
                            mask=r_mask[:, None] & n_mask[None, :], other=0)  # [WORDS, BLOCK_N]
        hi = words >> HI_SHIFT
        g = k0 // GROUP
        scale = tl.load(s_ptr + g * stride_sk + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        zero = tl.load(z_ptr + g * stride_sk + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        t = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(F):
            # x of input rows * F + j (the kernel's order), as float32: [WORDS]
            if HAS_PERM:
                src = tl.load(perm_ptr + rows * F + j, mask=r_mask, other=0)
                x = tl.load(x_ptr + src, mask=r_mask, other=0.0).to(tl.float32)
            elif X_PAIRS:
                if j % 2 == 0:
                    if EVEN_K:
                        pair = tl.load(x_pairs + rows * (F // 2) + j // 2)
                    else:
                        pair = tl.load(x_pairs + rows * (F // 2) + j // 2, mask=r_mask, other=0)
                    x = (pair << 16).to(tl.float32, bitcast=True)
                else:
                    x = (pair & -65536).to(tl.float32, bitcast=True)
            elif EVEN_K:
                x = tl.load(x_ptr + rows * F + j).to(tl.float32)
            else:
                x = tl.load(x_ptr + rows * F + j, mask=r_mask, other=0.0).to(tl.float32)
            if j < HALF:  # noqa: SIM108 (a constexpr branch, kept as a plain if for Triton)
                w = words
            else:
                w = hi
            bits_in = (w & (MASK << (BITS * (j % HALF)))) | (MAGIC - ((BITS * (j % HALF)) << 23))
            f = bits_in.to(tl.float32, bitcast=True)  # 2^(23 - b) + q, exactly
            t += (f - (zero + (1 << (23 - BITS * (j % HALF))))) * x[:, None]
        acc += t * scale
    _store_gemv(tl.sum(acc, axis=0), out_ptr, offs_n, n_mask, bias_ptr, offs_n, n_mask, pid_s, stride_os, HAS_BIAS,
                PARTIAL)


@_jit
def _gemm_tile(M, N, K, K_SPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A GEMM program's tile (grid: N tiles, M tiles, K splits): its split, token and output
    offsets with their masks, and the range of K it sums."""
    pid_s = tl.program_id(2)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = pid_s * K_SPLIT
    return pid_s, offs_m, offs_n, offs_m < M, offs_n < N, k_start, tl.minimum(k_start + K_SPLIT, K)


@_jit
def _x_tile(x_rows, perm_ptr, k0, m_mask, K, HAS_PERM: tl.constexpr, BLOCK_K: tl.constexpr,
            UNMASKED: tl.constexpr = False):
    """The activations ``x[rows, k0 : k0 + BLOCK_K]`` (act-order: the inputs ``perm`` names, the
    layer's sorted order), zero outside M and K: ``[BLOCK_M, BLOCK_K]``. ``UNMASKED``: every row
    pointer is valid (rows past M clamped to the last) and the tile lies inside K, so the loads
    need no predicates (at 256 tokens, five instructions an asynchronous copy fewer)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    if UNMASKED:
        if HAS_PERM:  # noqa: SIM108 (a constexpr branch, kept as a plain if for Triton)
            src = tl.load(perm_ptr + offs_k)
        else:
            src = offs_k
        return tl.load(x_rows + src[None, :])
    k_mask = offs_k < K
    if HAS_PERM:  # noqa: SIM108 (a constexpr branch, kept as a plain if for Triton)
        src = tl.load(perm_ptr + offs_k, mask=k_mask, other=0)
    else:
        src = offs_k
    return tl.load(x_rows + src[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)


@_jit
def _gemm_kernel(x_ptr, perm_ptr, qw_ptr, s_ptr, z_ptr, lut_ptr, bias_ptr, out_ptr,
                 M, N, K, K_SPLIT, stride_xm, stride_qk, stride_sk, stride_om, stride_os,
                 GROUP: tl.constexpr, BITS: tl.constexpr, F: tl.constexpr, LUT: tl.constexpr,
                 ONE_GROUP: tl.constexpr, WORDS: tl.constexpr, HAS_PERM: tl.constexpr,
                 HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, IEEE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False):
    # One program: a [BLOCK_M, BLOCK_N] output tile over K_SPLIT inputs (split pid_s).
    if USE_PDL:  # x comes from the kernel before
        pdl_prologue()
    pid_s, offs_m, offs_n, m_mask, n_mask, k_start, k_end = _gemm_tile(M, N, K, K_SPLIT, BLOCK_M, BLOCK_N)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        x = _x_tile(x_rows, perm_ptr, k0, m_mask, K, HAS_PERM, BLOCK_K)  # [BLOCK_M, BLOCK_K]
        w = _weight_tile(qw_ptr, s_ptr, z_ptr, lut_ptr, k0, offs_n, n_mask, K, stride_qk, stride_sk,
                         GROUP, BITS, F, LUT, ONE_GROUP, BLOCK_K, WORDS, BLOCK_N).to(x.dtype)
        if IEEE:  # noqa: SIM108 - float32 activations: no TF32 rounding of the operands
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    mask = m_mask[:, None] & n_mask[None, :]
    if PARTIAL:
        tl.store(out_ptr + pid_s * stride_os + offs_m[:, None] * stride_om + offs_n[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@_jit
def _int_tile_t(qw_ptr, s_ptr, z_ptr, k0, offs_n, n_mask, K, stride_qk, stride_sk, MAGIC,
                GROUP: tl.constexpr, BITS: tl.constexpr, F: tl.constexpr, WORDS: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """``W^T[k0 : k0 + BLOCK_K, offs_n]`` as float32 for integer codes whose K tile lies in one
    group, without an integer-to-float conversion: a code masked in place and ORed with the bits
    of the float 2^23 (``MAGIC``, a run-time argument so that the mask and the OR fold into one
    LOP3) *is* the float ``2^23 + q``; one FADD takes ``2^23 + zero`` off exactly (integer zeros),
    and one FMUL scales: the same float32 as :func:`_weight_tile`'s ``(q - zero) * scale``, so
    the tile rounded to the activations' dtype has the same bits."""
    words = _word_tile(qw_ptr, k0, offs_n, n_mask, K, stride_qk, F, WORDS)  # [BLOCK_K / F, BLOCK_N]
    g = k0 // GROUP
    s = tl.load(s_ptr + g * stride_sk + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g * stride_sk + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    shifts = tl.arange(0, F) * BITS
    q = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)  # [BLOCK_K / F, F, BLOCK_N]
    v = (q | MAGIC).to(tl.float32, bitcast=True) - (z + 8388608.0)[None, None, :]  # q - zero, exactly
    return tl.reshape(v * s[None, None, :], (BLOCK_K, BLOCK_N))


@_jit
def _int_tile_t_x2(qw_ptr, s_ptr, z_ptr, k0, offs_n, n_mask, K, stride_qk, stride_sk, MAGIC2,
                   GROUP: tl.constexpr, F: tl.constexpr, WORDS: tl.constexpr, BASE: tl.constexpr,
                   EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """:func:`_int_tile_t` for 4-bit codes, two weights to a 32-bit operation, in the
    activations' 16-bit dtype: the same bits as the float32 tile rounded once.

    Word ``w`` holds code ``j`` at bits ``4j`` (j < 8). ``(w >> 4j) & 0x000F000F`` puts codes
    ``j`` and ``j + 4`` in the low bits of its two half-words; ORed with ``MAGIC2`` (the 16-bit
    float ``BASE`` twice: bf16 0x4300 = 128, fp16 0x6400 = 1024, where the mantissa's unit is 1)
    each half *is* the float ``BASE + q`` (one LOP3 for two weights). ``(BASE + q) - (BASE +
    zero)`` is exact (a small integer), and one multiply by the scale rounds ``(q - zero) *
    scale`` once, as the float32 path's cast does (that product is exact in float32). Both are
    one two-wide instruction (inline PTX: Triton's vectorizer pairs the halves of different words
    instead, with a PRMT for each; bf16 as FMAs, which sm_80 has too); the float32 path spends a
    FADD, a FMUL and half a conversion on each weight."""
    words = _word_tile(qw_ptr, k0, offs_n, n_mask, K, stride_qk, F, WORDS, EVEN_K)  # [WORDS, BLOCK_N]
    g = k0 // GROUP
    s = tl.load(s_ptr + g * stride_sk + offs_n, mask=n_mask, other=0.0)  # [BLOCK_N], 16-bit
    zb = (tl.load(z_ptr + g * stride_sk + offs_n, mask=n_mask, other=0.0).to(tl.float32) + BASE).to(s.dtype)
    s1 = s.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    z1 = zb.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    s2 = (s1 | (s1 << 16))[None, None, :]  # the scale in both halves
    z2 = (z1 | (z1 << 16))[None, None, :]
    HALF: tl.constexpr = F // 2
    shifts = tl.arange(0, HALF) * 4
    shifted = words[:, None, :] >> shifts[None, :, None]  # [WORDS, HALF, BLOCK_N]
    if BASE == 128:  # (code j, code j + HALF) dequantized, low half first
        pair = tl.inline_asm_elementwise(
            # bf16x2 add and multiply are sm_90's; sm_80 has only the FMA: t * 1 - (BASE + zero)
            # and t * scale + (-0), each exact or rounded once as the subtract and multiply are
            "{ .reg .b32 t, nz, one, mz; mov.b32 one, 0x3F803F80; mov.b32 mz, 0x80008000; "
            "lop3.b32 t, $1, 0x000F000F, $2, 0xEA; xor.b32 nz, $3, 0x80008000; "
            "fma.rn.bf16x2 t, t, one, nz; fma.rn.bf16x2 $0, t, $4, mz; }",
            "=r,r,r,r,r", [shifted, MAGIC2, z2, s2], dtype=tl.int32, is_pure=True, pack=1)
    else:
        pair = tl.inline_asm_elementwise(
            "{ .reg .b32 t; lop3.b32 t, $1, 0x000F000F, $2, 0xEA; sub.rn.f16x2 t, t, $3; mul.rn.f16x2 $0, t, $4; }",
            "=r,r,r,r,r", [shifted, MAGIC2, z2, s2], dtype=tl.int32, is_pure=True, pack=1)
    lo = pair.to(tl.int16).to(s.dtype, bitcast=True)
    hi = (pair >> 16).to(tl.int16).to(s.dtype, bitcast=True)
    # input r * F + h * HALF + j of the tile: [WORDS, HALF, BLOCK_N, 2] -> [WORDS, 2, HALF, BLOCK_N]
    v = tl.permute(tl.join(lo, hi), (0, 3, 1, 2))
    return tl.reshape(v, (BLOCK_K, BLOCK_N))


@_jit
def _gemm_t_kernel(x_ptr, perm_ptr, qw_ptr, s_ptr, z_ptr, lut_ptr, bias_ptr, out_ptr,
                   M, N, K, K_SPLIT, stride_xm, stride_qk, stride_sk, stride_om, stride_os, MAGIC,
                   GROUP: tl.constexpr, BITS: tl.constexpr, F: tl.constexpr, LUT: tl.constexpr,
                   ONE_GROUP: tl.constexpr, WORDS: tl.constexpr, HAS_PERM: tl.constexpr,
                   HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, INT_CODES: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False,
                   PACKED_BASE: tl.constexpr = 0, EVEN_K: tl.constexpr = False):
    """:func:`_gemm_kernel` with the product transposed: ``acc[n, m] = W[n, :] . x[m, :]``, the
    dequantized weight tile as ``tl.dot``'s first operand and the tokens as its second (16-bit
    activations only). On Hopper the first operand of a wgmma may live in registers, so the
    dequantized tile goes from the ALUs straight into the MMA (compiled for sm_90: register A,
    ``HGMMA.64xBLOCK_Mx16``, 4 128-bit shared stores a thread an iteration where the plain kernel
    makes 32 16-bit ones for its shared B operand, ``scripts/w4a16_sass.py``); the activations
    are the shared operand, loaded by ``cp.async``. The tokens are the MMA's N, so a tile of 16
    to 256 tokens is one instruction wide. ``INT_CODES``: integer codes with one group a tile
    (:func:`_int_tile_t`); otherwise :func:`_weight_tile` (NF4's table, smaller groups).
    ``PACKED_BASE`` (128 for bf16, 1024 for fp16; 0: off): 4-bit integer codes through
    :func:`_int_tile_t_x2` instead, ``MAGIC`` then its two-half magic. ``EVEN_K``: K is whole
    tiles, so the activations load without predicates (rows past M clamped to the last)."""
    if USE_PDL:  # x comes from the kernel before
        pdl_prologue()
    pid_s, offs_m, offs_n, m_mask, n_mask, k_start, k_end = _gemm_tile(M, N, K, K_SPLIT, BLOCK_M, BLOCK_N)
    if EVEN_K:  # rows past M read the last row (their sums are never stored): no load predicates
        x_rows = x_ptr + tl.minimum(offs_m, M - 1).to(tl.int64)[:, None] * stride_xm
    else:
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        x = _x_tile(x_rows, perm_ptr, k0, m_mask, K, HAS_PERM, BLOCK_K, EVEN_K)  # [BLOCK_M, BLOCK_K]
        if PACKED_BASE != 0:
            w = _int_tile_t_x2(qw_ptr, s_ptr, z_ptr, k0, offs_n, n_mask, K, stride_qk, stride_sk, MAGIC,
                               GROUP, F, WORDS, PACKED_BASE, EVEN_K, BLOCK_K, BLOCK_N)
        elif INT_CODES:
            w = _int_tile_t(qw_ptr, s_ptr, z_ptr, k0, offs_n, n_mask, K, stride_qk, stride_sk, MAGIC,
                            GROUP, BITS, F, WORDS, BLOCK_K, BLOCK_N).to(x.dtype)
        else:
            w = _weight_tile(qw_ptr, s_ptr, z_ptr, lut_ptr, k0, offs_n, n_mask, K, stride_qk, stride_sk,
                             GROUP, BITS, F, LUT, ONE_GROUP, BLOCK_K, WORDS, BLOCK_N).to(x.dtype)
        acc = tl.dot(tl.trans(w), tl.trans(x), acc)  # [BLOCK_N, BLOCK_M]
    mask = n_mask[:, None] & m_mask[None, :]
    if PARTIAL:
        tl.store(out_ptr + pid_s * stride_os + offs_m[None, :] * stride_om + offs_n[:, None], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        out = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@_jit
def _dequant_kernel(perm_ptr, qw_ptr, s_ptr, z_ptr, lut_ptr, out_ptr, N, K, stride_qk, stride_sk, stride_ok,
                    GROUP: tl.constexpr, BITS: tl.constexpr, F: tl.constexpr, LUT: tl.constexpr,
                 ONE_GROUP: tl.constexpr, WORDS: tl.constexpr, HAS_PERM: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # One program: W^T[k tile, n tile] in the output dtype, rows put back in the layer's input order.
    k0 = tl.program_id(0) * BLOCK_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    w = _weight_tile(qw_ptr, s_ptr, z_ptr, lut_ptr, k0, offs_n, n_mask, K, stride_qk, stride_sk,
                     GROUP, BITS, F, LUT, ONE_GROUP, BLOCK_K, WORDS, BLOCK_N)
    if HAS_PERM:  # noqa: SIM108 (a constexpr branch, kept as a plain if for Triton)
        dst = tl.load(perm_ptr + offs_k, mask=k_mask, other=0)
    else:
        dst = offs_k
    out = out_ptr + dst.to(tl.int64)[:, None] * stride_ok + offs_n[None, :]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=k_mask[:, None] & n_mask[None, :])


# ------------------------------------------------------------------------------------------------
# Launch plans
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    kind: str  # "gemv", "gemm", "gemm_t" or "dense"
    block_m: int
    block_n: int
    block_k: int
    split: int  # programs along K
    k_split: int  # inputs per split (a multiple of block_k)
    num_warps: int
    num_stages: int


def block_k_for(group: int) -> int:
    """The largest K tile that stays inside one group (one row of scales a tile); 64 with
    per-input scale gathers when the group size is not a multiple of 16."""
    for b in (128, 64, 32, 16):
        if group % b == 0:
            return b
    return 64


@functools.lru_cache(maxsize=4096)
def plan(m: int, n: int, k: int, group: int, sms: int, dense_from: int, table: bool = False,
         act16: bool = True) -> Plan:
    """How a call of ``m`` tokens on an ``n x k`` layer runs (a pure function of the shapes, of
    whether the codes index a table, NF4, or are integers, and of whether the activations are
    16-bit: the transposed GEMM is for those)."""
    bk = block_k_for(group)
    if m >= dense_from:
        return Plan("dense", 0, 128, bk, 1, k, 4, 1)
    if m == 1 and not table and group % min(bk, 128) == 0:
        return _int_gemv_plan(n, k, min(bk, 128), sms)
    if m > 1 and act16 and GEMM_T:
        return _gemm_t_plan(m, n, k, bk, sms, packed=PACKED and PACKED_SPLIT_CAP and not table)
    if m == 1:  # a [128, 64] float32 accumulator: 64 registers a thread, several programs an SM
        kind, bm, bn, warps, stages = "gemv", 1, 128, 4, 2
        bk = min(bk, 64)  # still inside one group: group sizes are multiples of 64 or of bk
    elif m <= 16:
        kind, bm, bn, warps, stages = "gemm", 16, 64, 4, 4
    elif m <= 32:
        kind, bm, bn, warps, stages = "gemm", 32, 64, 4, 4
    elif m <= 64:
        kind, bm, bn, warps, stages = "gemm", 64, 128, 4, 3
    elif m <= 128:
        kind, bm, bn, warps, stages = "gemm", 128, 128, 8, 3
    else:
        return _wide_gemm_plan(m, n, k, bk, sms)
    tiles = -(-n // bn) * -(-m // bm)
    split, k_split = split_k(tiles, k, bk, _PROGRAMS_PER_SM[kind] * sms, _MAX_SPLIT[kind])
    return Plan(kind, bm, bn, bk, split, k_split, warps, stages)


def _wide_gemm_plan(m: int, n: int, k: int, bk: int, sms: int) -> Plan:
    """129 to ``DENSE_FROM_TOKENS - 1`` tokens (a large decode batch): 256-row tiles, 64 wide and
    64 deep, 4 warps, 3 stages, K split until the grid holds about two programs an SM.

    From the H200 sweep of 2026-12-03 (``scripts/bench_w4a16_plans.py --schemes gptq --tokens
    16,64,256 --quick``, bench/results/gpu-w4a16-plans-m16-256.json): at M = 256 on llama-8b's four
    layer shapes this plan with this rule's splits (qkv 4, o_proj 4, gate_up 1, down 4) measured
    55.7 / 32.8 / 189.7 / 92.2 us, against 82.2 / 79.2 / 269.7 / 160.4 for the 128 x 128, 8-warp
    plan before (1.6x for a layer's four GEMMs): a 256-row tile dequantizes each weight tile once
    for the whole batch. Within 1% of each shape's best measured plan. (bf16 cuBLAS on the same
    shapes: 23.1 / 14.7 / 92.5 / 49.5 us.)"""
    bm, bn, bk = 256, 64, min(bk, 64)
    tiles = -(-n // bn) * -(-m // bm)
    # ~1.9 programs an SM: the smallest power-of-two split reaching it (o_proj's 64 tiles: 4
    # splits, 256 programs; a target of 2 x 132 would have taken 8, measured 27% slower)
    split, k_split = split_k(tiles, k, bk, (15 * sms) // 8, _MAX_SPLIT["gemm"])
    return Plan("gemm", bm, bn, bk, split, k_split, 4, 3)


# The transposed GEMM's float32 partial sums (split x M x N x 4 bytes) are written and read back
# once: up to about this size they stay in L2 (50 MB on the H100 / H200). Past it a split costs
# more traffic than its parallelism saves (the sweep below: o_proj at 128 tokens, 16 splits and
# 34 MB of partials 41 us against 21 with 4; down_proj at 128 tokens, 16 splits and 34 MB, was
# still the fastest, 61.7 us against 66.8 with 8).
_GEMM_T_PARTIAL_BYTES = 36 << 20


def _gemm_t_plan(m: int, n: int, k: int, bk: int, sms: int, packed: bool = False) -> Plan:
    """2 to ``DENSE_FROM_TOKENS - 1`` tokens, 16-bit activations: :func:`_gemm_t_kernel` with
    tiles of 64 weight rows (one warpgroup's wgmma) by the smallest power of two from 16 that
    holds the tokens, 64 deep, 4 warps, 4 stages up to 64 tokens (3 above). K is split into
    pieces of about 1,024 inputs (a power of two of them, at most 16); at 16 tokens or fewer
    into pieces down to ~512 while the grid holds fewer than 3 programs an SM (qkv_proj and
    o_proj: 8 splits, 14.2 and 10.8 us against 16.1 and 13.4 with 4); halved while the partial
    sums would pass ``_GEMM_T_PARTIAL_BYTES`` (36 MB: gate_up_proj at 128 tokens keeps 2 splits,
    118.2 us against 128.1 with 1, and down_proj 16, 61.7 against 66.8 with 8). Every split this
    rule gives llama-8b's layers at 16, 64 and 128 tokens is the fastest of that sweep.

    From the sweep of session 31 (an H100 of 132 SMs, ``scripts/bench_w4a16_plans.py --schemes
    gptq --tokens 64,128,16 --quick --transposed-only``, bench/results/gpu-w4a16-plans-gemm-t-h100-s31.json):
    over llama-8b's four layers (group 128) this rule's plans sum to 155.9 / 243.4 / 116.5 us at
    64 / 128 / 16 tokens, against 152.7 / 219.8 / 110.4 for each layer's fastest plan and 179.4 /
    360.0 / 132.5 for the plain GEMM's rule (timed as the rule in a later call:
    bench/results/gpu-w4a16-plans-gemm-t-rule2-h100-s31.json, 155.0 / 241.1 / 120.8). Splitting for a number of programs an SM instead
    (four: 218.8 / 312.4 / 116.6 us, with 128-deep tiles) made too many partial sums at 64-128
    tokens; 128-deep tiles won on gate_up at 128 tokens and lost on qkv and at 64 tokens.

    ``packed`` (integer codes, where the packed 4-bit tile runs): from 128 tokens the split is
    also halved while the grid would hold more than 4 programs an SM counted in 128-row tiles
    (``split * N/64 * block_m/128 > 4 * sms``). The packed tile's programs dequantize faster, so
    the partial sums' round trip weighs more: two H100 sweeps of it (sessions 42 and 45,
    bench/results/gpu-w4a16-plans-packed-h100-s42.json and -s45.json) found at 128 tokens
    gate_up_proj fastest with 1 split (85.6 / 86.6 us against 99.9 / 100.4 with 2) and
    down_proj with 8 (43.9 / 44.1 against 55.2 / 55.3 with 16), and at 256 tokens qkv_proj with
    2 (50.4 / 50.2 against 54.9 / 55.2 with 4) and down_proj with 4 (78.8 / 80.7 against 89.4 /
    90.0 with 8): the splits this cap gives, and it leaves the other four shapes' fastest
    splits (qkv and o_proj at 128 tokens, o_proj and gate_up at 256) and every split up to 64
    tokens as they were. Over the four layers 1.15x at 128 tokens (173 against 199 us) and 1.05x
    at 256. 8-bit GPTQ codes (the float32 tile) get the cap too, since a plan does not know the
    bit width; their splits at 128 tokens and up were not swept either way."""
    bm = min(256, max(16, 1 << (m - 1).bit_length()))
    bn, bk = 64, min(bk, 64)
    k_blocks = -(-k // bk)
    split = 1
    while split * 2 <= min(_MAX_SPLIT["gemm"], k_blocks) and k / (split * 2) >= 768:
        split *= 2  # the power of two nearest k / 1024 (768 and up rounds to another split)
    if bm <= 16:  # a program's MMAs are short: pieces down to ~512 inputs for ~3 programs an SM
        tiles = -(-n // bn)
        while (split * 2 <= min(_MAX_SPLIT["gemm"], k_blocks) and k / (split * 2) >= 384
               and tiles * split < 3 * sms):
            split *= 2
    while split > 1 and split * m * n * 4 > _GEMM_T_PARTIAL_BYTES:
        split //= 2
    if packed and bm >= 128:
        while split > 1 and split * -(-n // bn) * (bm // 128) > 4 * sms:
            split //= 2
    k_split = -(-k_blocks // split) * bk
    return Plan("gemm_t", bm, bn, bk, -(-k // k_split), k_split, 4, 4 if bm <= 64 else 3)


def _int_gemv_plan(n: int, k: int, bk: int, sms: int) -> Plan:
    """The integer-code GEMV's plan (:func:`_gemv_int_kernel`): 64-wide, ``bk``-deep tiles (up to
    128, inside one group), splits of about 512 inputs, halved while the grid holds fewer than
    4 programs an SM (and a split has more than one K tile left), at most 32 splits.

    From the H200 sweep of 2026-12-03 (``scripts/bench_w4a16_plans.py --schemes gptq,awq
    --tokens 1 --quick``, bench/results/gpu-w4a16-plans-m1-int.json): on llama-8b's four layer
    shapes this rule picks each shape's fastest measured plan (qkv 8 splits, o_proj 16, gate_up
    8, down 28), 1.11-1.31x faster than the general GEMV's rule on the same kernel."""
    k_blocks = -(-k // bk)
    tiles = -(-n // 64)
    limit = _MAX_SPLIT["gemv"]
    per_split = max(1, 512 // bk, -(-k_blocks // limit))  # K tiles a split

    def splits(per: int) -> int:
        return -(-k_blocks // per)

    while per_split > 1 and tiles * splits(per_split) < 4 * sms and splits(per_split // 2) <= limit:
        per_split //= 2
    k_split = per_split * bk
    return Plan("gemv", 1, 64, bk, -(-k // k_split), k_split, 4, 2)


@functools.cache
def _sm_count(device_index: int | None) -> int:
    return int(torch.cuda.get_device_properties(device_index or 0).multi_processor_count)


def sm_count(device: torch.device) -> int:
    return _sm_count(device.index) if device.type == "cuda" else 4


# ------------------------------------------------------------------------------------------------
# What a token count compiles (the warm-up before serving covers every variant)
# ------------------------------------------------------------------------------------------------


def _spec(value: int) -> str:
    """How Triton specialises an integer argument when it compiles: the value 1, a multiple of
    16, or neither (a new class is a new compile)."""
    return "1" if value == 1 else "16" if value % 16 == 0 else "-"


def _segment_variant(m: int, n: int, p: Plan) -> tuple[Any, ...]:
    """The kernels a call of ``m`` tokens on an ``n``-column segment launches under plan ``p``,
    as far as they can differ between token counts on one layer: the plan's constexprs and the
    specialisation of the integer arguments that vary with ``m`` (``_fused`` argument by
    argument: ``M``, ``K_SPLIT``, the partial sums' ``stride_os = m * n`` and the split-sum's
    ``SPLIT``). The layer's own constants (flags, N, K, strides, the bias) are the same for every
    count and left out."""
    if p.kind == "dense":  # one dequantize launch of a fixed plan, then cuBLAS (nothing compiled)
        return ("dense", p)
    partial = p.split > 1
    return (p.kind, p.block_m, p.block_n, p.block_k, p.num_warps, p.num_stages, partial, _spec(m),
            _spec(p.k_split), _spec(m * n) if partial else "", _spec(p.split) if partial else "")


def launch_variant(m: int, in_features: int, group_size: int, widths: tuple[int, ...], sms: int,
                   dense_from: int | None = None, table: bool = False, act16: bool = True) -> tuple[Any, ...]:
    """What Triton compiles for a call of ``m`` tokens on a layer of ``in_features`` inputs whose
    segments are ``widths`` columns wide, one entry per segment (``table``: NF4's codes). Two
    counts with equal variants launch the same compiled kernels on that layer."""
    dense = DENSE_FROM_TOKENS if dense_from is None else dense_from
    p = plan(m, sum(widths), in_features, group_size, sms, dense, table, act16)
    return tuple(_segment_variant(m, n, p) for n in widths)


@functools.lru_cache(maxsize=256)
def covering_token_counts(in_features: int, group_size: int, widths: tuple[int, ...], max_tokens: int, sms: int,
                          dense_from: int | None = None, table: bool = False, act16: bool = True) -> tuple[int, ...]:
    """The fewest token counts in ``1..max_tokens`` (the smallest of each variant) whose calls
    compile every variant that a call of any count in that range launches on such a layer. Every
    count from ``dense_from`` up shares the dense variant, so the scan stops there."""
    dense = DENSE_FROM_TOKENS if dense_from is None else dense_from
    seen: set[tuple[Any, ...]] = set()
    counts = []
    for m in range(1, min(max_tokens, dense) + 1):
        variant = launch_variant(m, in_features, group_size, widths, sms, dense, table, act16)
        if variant not in seen:
            seen.add(variant)
            counts.append(m)
    return tuple(counts)


def layer_warm_up_token_counts(layer: Any, max_tokens: int) -> tuple[int, ...]:
    """A ``DequantLinearMethod`` warm-up: the token counts that compile every kernel variant of
    the layer's repacked weight (none when it was not repacked or the kernels are switched off).
    Where variants change does not depend on the bias, so one list serves calls with and without."""
    layout: W4A16Layout | None = layer.__dict__.get("w4a16")
    if layout is None or not HAS_TRITON or not kernel_switches.fused_kernels:
        return ()
    widths = tuple(seg.end - seg.start for seg in layout.segments)
    return covering_token_counts(layout.in_features, layout.group_size, widths, max_tokens,
                                 sm_count(layout.qweight.device), table=uses_table(layout),
                                 act16=layout.dtype != torch.float32)


# ------------------------------------------------------------------------------------------------
# Entry points
# ------------------------------------------------------------------------------------------------


def _seg_args(layout: W4A16Layout, seg: Segment) -> tuple[torch.Tensor, ...]:
    cols = slice(seg.start, seg.end)
    qw, s = layout.qweight[:, cols], layout.scales[:, cols]
    z = layout.zeros[:, cols] if layout.zeros is not None else s  # not read for NF4
    perm = seg.perm if seg.perm is not None else qw  # not read without act-order
    lut = seg.table if seg.table is not None else s  # not read for integer codes
    return perm, qw, s, z, lut


def _layout_flags(layout: W4A16Layout, seg: Segment, block_k: int) -> dict[str, Any]:
    f = 32 // layout.bits
    return dict(GROUP=layout.group_size, BITS=layout.bits, F=f, LUT=seg.table is not None,
                ONE_GROUP=layout.group_size % block_k == 0, WORDS=block_k // f, HAS_PERM=seg.perm is not None)


def w4a16_linear(x: torch.Tensor, layout: W4A16Layout, bias: torch.Tensor | None = None,
                 dense_from: int | None = None) -> torch.Tensor:
    """``x [..., K] @ W^T (+ bias)`` in ``x``'s dtype, W given by ``layout``."""
    k, n = layout.in_features, layout.out_features
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*lead, n)
    p = plan(m, n, k, layout.group_size, sm_count(x.device), DENSE_FROM_TOKENS if dense_from is None else dense_from,
             uses_table(layout), x.element_size() == 2)
    if p.kind == "dense":
        wt = dequantize_t(layout, x.dtype, p)
        if bias is None:
            torch.matmul(x2, wt, out=out)
        else:
            torch.addmm(bias.to(x.dtype), x2, wt, out=out)
        return out.view(*lead, n)
    for seg in layout.segments:
        _fused(x2, layout, seg, bias, out[:, seg.start:seg.end], p)
    return out.view(*lead, n)


_MAGIC = 0x4B000000  # the float 2^23's bits (see _gemv_int_kernel)
# LOOM_W4A16_INT_GEMV=0 keeps integer codes on the general GEMV (for side-by-side benchmarks)
INT_GEMV = os.environ.get("LOOM_W4A16_INT_GEMV", "1") != "0"
# The 16-bit float BASE twice, by BASE (see _int_tile_t_x2): bf16 128.0, fp16 1024.0
_MAGIC2 = {128: 0x43004300, 1024: 0x64006400}
# The transposed GEMM dequantizes 4-bit integer codes two to a 32-bit operation in the
# activations' dtype (_int_tile_t_x2: the float32 tile's bits) and loads whole K tiles without
# predicates: over llama-8b's four layers on an H100 1.21x / 1.09x / 1.25x / 1.10x faster at
# 16 / 64 / 128 / 256 tokens (bench/results/gpu-w4a16-plans-packed-h100-s42.json).
# LOOM_W4A16_PACKED=0 keeps the float32 tile (side-by-side runs). Read once at import.
PACKED = os.environ.get("LOOM_W4A16_PACKED", "1") != "0"


# The kernels were defined for the interpreter (chosen at import; it has no inline PTX)
_INTERPRETED = interpreting()


def _packed_base(layout: W4A16Layout, seg: Segment, block_k: int, dtype: torch.dtype) -> int:
    """The packed tile's BASE for a segment's transposed GEMM, 0 where it does not apply:
    switched off, the interpreter, codes other than 4-bit integers in one group a tile."""
    if not PACKED or _INTERPRETED or layout.bits != 4 or not _int_codes(layout, seg, block_k):
        return 0
    return {torch.bfloat16: 128, torch.float16: 1024}.get(dtype, 0)


def uses_table(layout: W4A16Layout) -> bool:
    """Whether the layout's codes index a table (NF4) rather than being integers: what
    :func:`plan` is told, since the two GEMVs want different plans at one token."""
    return any(seg.table is not None for seg in layout.segments)


def _int_codes(layout: W4A16Layout, seg: Segment, block_k: int) -> bool:
    """Whether a tile of ``block_k`` inputs of the segment is integer codes in one group (the
    magic-number dequantization of :func:`_int_tile_t`)."""
    return seg.table is None and layout.group_size % block_k == 0


def _int_gemv(layout: W4A16Layout, seg: Segment, p: Plan) -> bool:
    """Whether a one-token call runs :func:`_gemv_int_kernel`: integer codes (not a table) whose
    K tiles each lie in one group."""
    return INT_GEMV and seg.table is None and layout.group_size % p.block_k == 0


def _fused(x2: torch.Tensor, layout: W4A16Layout, seg: Segment, bias: torch.Tensor | None, out: torch.Tensor,
           p: Plan) -> None:
    m, k = x2.shape
    n = seg.end - seg.start
    perm, qw, s, z, lut = _seg_args(layout, seg)
    b = bias[seg.start:seg.end] if bias is not None else s
    partial = p.split > 1
    target = torch.empty(p.split, m, n, dtype=torch.float32, device=x2.device) if partial else out
    stride_os = target.stride(0) if partial else 0
    stride_om = target.stride(1) if partial else out.stride(0)
    flags = dict(**_layout_flags(layout, seg, p.block_k), HAS_BIAS=bias is not None, PARTIAL=partial,
                 BLOCK_N=p.block_n, BLOCK_K=p.block_k, num_warps=p.num_warps, num_stages=p.num_stages,
                 **pdl_launch(x2.device))
    if p.kind == "gemv" and _int_gemv(layout, seg, p):
        _gemv_int_kernel[(triton.cdiv(n, p.block_n), p.split)](
            x2, perm, qw, s, z, b, target, n, k, p.k_split, qw.stride(0), s.stride(0), stride_os, _MAGIC, 16,
            GROUP=layout.group_size, BITS=layout.bits, F=flags["F"], WORDS=flags["WORDS"], HAS_PERM=flags["HAS_PERM"],
            EVEN_K=k % p.block_k == 0,
            X_PAIRS=x2.dtype == torch.bfloat16 and seg.perm is None and x2.data_ptr() % 4 == 0,
            HAS_BIAS=bias is not None, PARTIAL=partial, BLOCK_N=p.block_n, BLOCK_K=p.block_k,
            num_warps=p.num_warps, num_stages=p.num_stages, **pdl_launch(x2.device))
    elif p.kind == "gemv":
        _gemv_kernel[(triton.cdiv(n, p.block_n), p.split)](x2, perm, qw, s, z, lut, b, target, n, k, p.k_split, qw.stride(0), s.stride(0),
                           stride_os, **flags)
    elif p.kind == "gemm_t":
        base = _packed_base(layout, seg, p.block_k, x2.dtype)
        _gemm_t_kernel[(triton.cdiv(n, p.block_n), triton.cdiv(m, p.block_m), p.split)](
            x2, perm, qw, s, z, lut, b, target, m, n, k, p.k_split, x2.stride(0), qw.stride(0), s.stride(0), stride_om,
            stride_os, _MAGIC2[base] if base else _MAGIC, INT_CODES=_int_codes(layout, seg, p.block_k),
            BLOCK_M=p.block_m, PACKED_BASE=base, EVEN_K=PACKED and not _INTERPRETED and k % p.block_k == 0, **flags)
    else:
        _gemm_kernel[(triton.cdiv(n, p.block_n), triton.cdiv(m, p.block_m), p.split)](x2, perm, qw, s, z, lut, b, target, m, n, k, p.k_split, x2.stride(0), qw.stride(0),
                           s.stride(0), stride_om, stride_os, IEEE=x2.dtype == torch.float32,
                           BLOCK_M=p.block_m, **flags)
    if partial:
        block = 256
        _split_sum_kernel[(m, triton.cdiv(n, block))](target, b, out, n, p.split, target.stride(0),
                                                     target.stride(1), out.stride(0), HAS_BIAS=bias is not None,
                                                     BLOCK_N=block, num_warps=4, **pdl_launch(x2.device))


def dequantize_t(layout: W4A16Layout, dtype: torch.dtype, p: Plan | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``W^T [K, N]`` in ``dtype``, in the layer's input order, by the dequantizing kernel (into
    ``out`` when given: a contiguous ``[K, N]`` tensor of ``dtype``)."""
    k, n = layout.in_features, layout.out_features
    p = p or plan(DENSE_FROM_TOKENS, n, k, layout.group_size, 1, DENSE_FROM_TOKENS)
    wt = torch.empty(k, n, dtype=dtype, device=layout.qweight.device) if out is None else out
    for seg in layout.segments:
        perm, qw, s, z, lut = _seg_args(layout, seg)
        dst = wt[:, seg.start:seg.end]
        grid = (triton.cdiv(k, p.block_k), triton.cdiv(seg.end - seg.start, p.block_n))
        _dequant_kernel[grid](perm, qw, s, z, lut, dst, seg.end - seg.start, k, qw.stride(0), s.stride(0),
                              dst.stride(0), **_layout_flags(layout, seg, p.block_k), BLOCK_N=p.block_n,
                              BLOCK_K=p.block_k, num_warps=4)
    return wt


def repacks_on(device: torch.device) -> bool:
    """Whether layers loaded on ``device`` are repacked for these kernels (CUDA, Triton installed)."""
    return device.type == "cuda" and HAS_TRITON


def layer_kernel(layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """A ``DequantLinearMethod`` kernel: the layer's repacked weight (None when it was not
    repacked, when ``LOOM_FUSED_KERNELS=0``, or for another activation dtype)."""
    layout = layer.__dict__.get("w4a16")
    if layout is None or not kernel_switches.fused_kernels or x.dtype != layout.dtype:
        return None
    return w4a16_linear(x, layout, bias)
