"""Fused Triton kernels for the elementwise work of a Llama-family layer, used on CUDA only.

Unfused, a decode step spends more time launching tiny elementwise kernels than doing them
(RMSNorm alone is eight: cast, pow, mean, add eps, rsqrt, mul, cast, weight multiply). Each
kernel here does one such group in one launch:

* ``fused_add_rms_norm``: ``h = residual + x`` (optional), then HF's RMSNorm of ``h``;
  ``fused_combine_add_rms_norm`` the same where ``x`` is an MoE layer's output still as its
  tokens' expert rows, summed with their routing weights first (the MoE combine, folded in).
* ``rotary``: rotate-half RoPE of q and k together, reading cos/sin at each token's position.
* ``qk_norm_rotary``: Qwen3's (or Gemma 3's) per-head RMSNorm of q and k, then that RoPE: the
  two head norms and the rotation of a layer in one launch instead of three.
* ``silu_and_mul``: ``silu(gate) * up`` of a fused ``[gate | up]`` projection.

They reproduce the torch path's roundings, not just its math: every intermediate that torch
materialises in the activation dtype is rounded to that dtype here too (computing in float32 and
casting with round-to-nearest-even, which is what torch's half-precision ops do). So bf16/fp16
outputs are bit-identical to the torch path, except the norm, whose float32 sum of squares is
reduced in a different order (a float32 ulp there can move the rounded output by one ulp).
float32 kernels are compiled without FMA contraction, so their products are rounded as torch's.

Launches depend only on shapes (no host syncs, no data-dependent sizes): CUDA-graph capturable.
Triton is optional: without it this module still imports and ``enabled`` is always False.
"""

# mypy: disable-error-code="no-untyped-def"
# (Triton kernels take untyped pointer arguments; annotations there would change their meaning.)
from __future__ import annotations

import torch

from loom import kernel_switches
from loom.layers.triton_jit import jit as _jit
from loom.layers.triton_jit import pdl_launch, pdl_prologue

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

# A norm row is held in registers in one block; past this, the torch path is used instead.
_MAX_NORM_BLOCK = 32768


def enabled(x: torch.Tensor) -> bool:
    """Whether the fused kernels serve tensors like ``x``: on CUDA, with triton installed,
    unless ``LOOM_FUSED_KERNELS=0`` (see :mod:`loom.kernel_switches`)."""
    return x.is_cuda and HAS_TRITON and kernel_switches.fused_kernels


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@_jit
def _round(x, dtype: tl.constexpr):
    """``x`` (float32) rounded to ``dtype`` and widened back: what torch stores between two ops."""
    return x.to(dtype).to(tl.float32)


# ------------------------------------------------------------------------------------------------
# (residual add +) RMSNorm
# ------------------------------------------------------------------------------------------------


def norm_supported(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether ``fused_add_rms_norm`` handles these operands (else use the torch path).

    The weight must share the activation dtype: HF's ``weight * h.to(dtype)`` would otherwise
    promote the output to the weight's dtype.
    """
    ok = (enabled(x) and x.dim() in (2, 3) and x.stride(-1) == 1 and weight.dtype == x.dtype
          and _next_pow2(x.shape[-1]) <= _MAX_NORM_BLOCK)
    if residual is not None:
        ok = ok and residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
    return ok


def norm_warps(block: int) -> int:
    """Warps of a norm program over a ``block``-wide row (``_add_rms_norm_kernel``'s choice, which
    ``qk_norm_rotary`` shares so that both reduce a head in the same order)."""
    return min(16, max(1, block // 256))


@_jit
def _add_norm_row(x_ptr, res_ptr, w_ptr, res_out_ptr, ew_ptr, t, r, stride_xt, stride_xr, stride_rt, stride_rr,
                  R, H, eps, dtype: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                  TOP_K: tl.constexpr):
    """Row (t, r): ``h = residual + x`` (stored at ``res_out``), then HF's RMSNorm of ``h`` times the
    weight, as float32 values rounded to ``dtype`` (what is stored); masked columns are 0.
    Returns (those values ``[BLOCK]``, the columns, their mask, the row's offset in the output)."""
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    if TOP_K > 0:
        # x is an MoE layer's output as token t's k expert rows (t * k + j): their weighted sum,
        # in float32, j in order, each term and the sum rounded, as fused_moe_triton's
        # _combine_kernel computes it (R = 1).
        h = tl.zeros([BLOCK], tl.float32)
        for j in tl.static_range(TOP_K):
            ew = tl.load(ew_ptr + t * TOP_K + j).to(tl.float32)
            y = tl.load(x_ptr + (t * TOP_K + j) * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
            h += _round(y * ew, dtype)
        h = _round(h, dtype)
    else:
        h = tl.load(x_ptr + t * stride_xt + r * stride_xr + cols, mask=mask, other=0.0).to(tl.float32)
    out_row = (t * R + r) * H
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + t * stride_rt + r * stride_rr + cols, mask=mask, other=0.0)
        h = _round(res.to(tl.float32) + h, dtype)  # torch's add, rounded to the activation dtype
        tl.store(res_out_ptr + out_row + cols, h.to(dtype), mask=mask)
    # HF: statistics in float32; the normalised value is cast to the activation dtype *before*
    # the weight multiply, whose product is rounded again. Masked columns are 0: no effect.
    variance = tl.sum(h * h, axis=0) / H
    normed = _round(h * tl.rsqrt(variance + eps), dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return _round(w * normed, dtype), cols, mask, out_row


@_jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr,  # [T, R, H] views, unit stride along H (R = 1 for a 2-D input); TOP_K: x [T * k, H]
    w_ptr,  # [H]
    out_ptr, res_out_ptr,  # [T, R, H] contiguous: the normed rows, and h = residual + x
    ew_ptr,  # TOP_K: [T, k] routing weights of x's expert rows (else unused)
    stride_xt, stride_xr, stride_rt, stride_rr,
    R, H, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, TOP_K: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    # One program normalises one row (t, r).
    if USE_PDL:  # x and the residual come from the kernels before
        pdl_prologue()
    t = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1)
    dtype = out_ptr.dtype.element_ty
    y, cols, mask, out_row = _add_norm_row(x_ptr, res_ptr, w_ptr, res_out_ptr, ew_ptr, t, r, stride_xt, stride_xr,
                                           stride_rt, stride_rr, R, H, eps, dtype, HAS_RESIDUAL, BLOCK, TOP_K)
    tl.store(out_ptr + out_row + cols, y.to(dtype), mask=mask)


@_jit
def _quantize_row_store(y, cols, mask, q_row_ptr, scale_ptr, static_ptr, STATIC: tl.constexpr):
    """One row's values ``y`` (float32, masked columns 0) to e4m3 as ``fp8_triton.quantize_rows``
    makes them: the row's scale ``max(max|y| / 448, 1e-12)`` (or the static one), codes
    ``clamp(y / scale, -448, 448)``, IEEE divisions; stores the codes and the scale."""
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(y), axis=0), 448.0), 1e-12)
    q = tl.clamp(tl.math.div_rn(y, scale), -448.0, 448.0)
    tl.store(q_row_ptr + cols, q.to(q_row_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr, scale)


@_jit
def _add_rms_norm_quant_kernel(
    x_ptr, res_ptr,  # [T, H], unit stride along H
    w_ptr,  # [H]
    q_ptr, scale_ptr,  # [T, H] e4m3 contiguous, [T] float32: the normed rows quantized
    res_out_ptr,  # [T, H] contiguous: h = residual + x
    static_ptr,  # STATIC: [1] float32, every row's scale
    stride_xt, stride_rt, H, eps,
    HAS_RESIDUAL: tl.constexpr, STATIC: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    # One program normalises and quantizes one row: _add_rms_norm_kernel's values (never stored
    # in the activation dtype), quantized as the FP8 layer that takes them would quantize them.
    if USE_PDL:
        pdl_prologue()
    t = tl.program_id(0).to(tl.int64)
    dtype = res_out_ptr.dtype.element_ty  # x's (res_out is x itself without a residual)
    y, cols, mask, out_row = _add_norm_row(x_ptr, res_ptr, w_ptr, res_out_ptr, w_ptr, t, 0, stride_xt, 0,
                                           stride_rt, 0, 1, H, eps, dtype, HAS_RESIDUAL, BLOCK, 0)
    _quantize_row_store(y, cols, mask, q_ptr + out_row, scale_ptr + t, static_ptr, STATIC)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + x`` (``h = x`` without a residual), returns ``(rms_norm(h) * weight, h)``.

    ``x``: ``[T, H]``, or ``[T, R, H]`` for a per-head norm (Qwen3's q/k norm over a strided
    view of the qkv output); ``weight``: ``[H]``. The normed output is a new contiguous tensor
    shaped like ``x``, and so is ``h`` unless there is no residual (then ``h`` is ``x``); no
    operand is written. See ``norm_supported`` for what is accepted.
    """
    x3 = x if x.dim() == 3 else x.unsqueeze(1)  # [T, R, H]
    T, R, H = x3.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is None:
        res3, res_out = x3, x  # res_ptr/res_out_ptr are not read nor written without HAS_RESIDUAL
    else:
        res3 = residual if residual.dim() == 3 else residual.unsqueeze(1)
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out, res_out
    block = _next_pow2(H)
    _add_rms_norm_kernel[(T, R)](
        x3, res3, weight, out, res_out, weight,
        x3.stride(0), x3.stride(1), res3.stride(0), res3.stride(1),
        R, H, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, TOP_K=0,
        num_warps=norm_warps(block), enable_fp_fusion=False, **pdl_launch(x.device),
    )
    return out, res_out


def fused_add_rms_norm_quant(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                             static_scale: torch.Tensor | None, *,
                             warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fused_add_rms_norm`` of a 2-D ``x [T, H]`` whose normed rows go straight to e4m3 as
    ``fp8_triton.quantize_rows`` would quantize them (the same codes and scales, bit for bit):
    returns ``(codes [T, H] float8_e4m3fn, scales [T, 1] float32, h [T, H])``; ``h`` is ``x``
    without a residual. ``static_scale``: ``[1]`` float32 for every row, or None (per row);
    ``warps``: another launch than the plain norm's (measurements)."""
    T, H = x.shape
    codes = torch.empty((T, H), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((T, 1), dtype=torch.float32, device=x.device)
    res = x if residual is None else residual
    res_out = x if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if T == 0:
        return codes, scales, res_out
    block = _next_pow2(H)
    _add_rms_norm_quant_kernel[(T,)](
        x, res, weight, codes, scales, res_out, static_scale if static_scale is not None else scales,
        x.stride(0), res.stride(0), H, eps,
        HAS_RESIDUAL=residual is not None, STATIC=static_scale is not None,
        BLOCK=block, num_warps=warps or norm_warps(block), enable_fp_fusion=False, **pdl_launch(x.device),
    )
    return codes, scales, res_out


def combine_norm_supported(rows: torch.Tensor, expert_weights: torch.Tensor, weight: torch.Tensor,
                           residual: torch.Tensor) -> bool:
    """Whether ``fused_combine_add_rms_norm`` handles these operands (else combine, then norm)."""
    return (enabled(rows) and rows.dim() == 2 and rows.stride(-1) == 1 and expert_weights.dim() == 2
            and expert_weights.is_contiguous() and 0 < expert_weights.shape[1] <= 64
            and rows.shape[0] == expert_weights.numel() and weight.dtype == rows.dtype
            and residual.shape == (expert_weights.shape[0], rows.shape[1]) and residual.dtype == rows.dtype
            and residual.stride(-1) == 1 and _next_pow2(rows.shape[1]) <= _MAX_NORM_BLOCK)


def fused_combine_add_rms_norm(rows: torch.Tensor, expert_weights: torch.Tensor, residual: torch.Tensor,
                               weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_add_rms_norm(x, residual, weight, eps)`` where ``x[t] = sum_j expert_weights[t, j] *
    rows[t * k + j]`` is an MoE layer's output (``rows [T * k, H]``, ``expert_weights [T, k]``),
    summed here exactly as ``fused_moe_triton.combine_rows`` sums it: one launch for the combine,
    the residual add and the norm. Returns ``(normed [T, H], h [T, H])``."""
    T, k = expert_weights.shape
    H = rows.shape[1]
    out = torch.empty((T, H), dtype=rows.dtype, device=rows.device)
    res_out = torch.empty((T, H), dtype=rows.dtype, device=rows.device)
    if out.numel() == 0:
        return out, res_out
    block = _next_pow2(H)
    _add_rms_norm_kernel[(T, 1)](
        rows, residual, weight, out, res_out, expert_weights,
        rows.stride(0), 0, residual.stride(0), 0,
        1, H, eps,
        HAS_RESIDUAL=True, BLOCK=block, TOP_K=k,
        num_warps=norm_warps(block), enable_fp_fusion=False, **pdl_launch(rows.device),
    )
    return out, res_out


# ------------------------------------------------------------------------------------------------
# Rotary embedding (rotate-half / NeoX layout)
# ------------------------------------------------------------------------------------------------


def rotary_supported(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether ``rotary`` handles these operands (else use the torch path)."""
    return (enabled(q) and q.dim() == 3 and k.dim() == 3 and q.dtype == k.dtype
            and q.shape[-1] == k.shape[-1] and q.shape[-1] % 2 == 0
            and q.stride(-1) == 1 and k.stride(-1) == 1
            and positions.shape == (q.shape[0],) and k.shape[0] == q.shape[0])


@_jit
def _rotate_heads(src, dst, stride_h, heads, cos, sin,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK: tl.constexpr):
    """All heads of one token: ``[x1 | x2] -> [x1*cos - x2*sin | x2*cos + x1*sin]``, each product
    and each sum rounded to the dtype as torch's separate ops are.

    ``src``: ``heads`` rows of D = 2*HALF elements, ``stride_h`` apart; ``dst``: the same rows,
    contiguous; ``cos``/``sin``: ``[BLOCK]`` float32, already rounded to the dtype.
    """
    dtype = dst.dtype.element_ty
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK)[None, :]
    mask = (h < heads) & (d < HALF)
    x1 = tl.load(src + h * stride_h + d, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK]
    x2 = tl.load(src + h * stride_h + HALF + d, mask=mask, other=0.0).to(tl.float32)
    c, s = cos[None, :], sin[None, :]
    out1 = _round(x1 * c, dtype) - _round(x2 * s, dtype)
    out2 = _round(x2 * c, dtype) + _round(x1 * s, dtype)
    tl.store(dst + h * (2 * HALF) + d, out1.to(dtype), mask=mask)
    tl.store(dst + h * (2 * HALF) + HALF + d, out2.to(dtype), mask=mask)


@_jit
def _rotary_kernel(
    q_ptr, k_ptr,  # [T, Hq, D] and [T, Hkv, D] views, unit stride along D
    q_out_ptr, k_out_ptr,  # the same shapes, contiguous
    pos_ptr,  # [T] integer positions
    cos_ptr, sin_ptr,  # [P, D/2] float32 tables
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos,
    HQ, HKV,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    # One program rotates every q and k head of one token, reading its cos/sin row once.
    if USE_PDL:  # q and k come from the qkv projection
        pdl_prologue()
    t = tl.program_id(0).to(tl.int64)
    dtype = q_out_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    # The float32 tables are cast to the activation dtype first, as HF does.
    cos = _round(tl.load(cos_ptr + pos * stride_cos + offs, mask=mask, other=0.0), dtype)
    sin = _round(tl.load(sin_ptr + pos * stride_cos + offs, mask=mask, other=0.0), dtype)
    _rotate_heads(q_ptr + t * stride_qt, q_out_ptr + t * HQ * (2 * HALF), stride_qh, HQ, cos, sin,
                  HALF, BLOCK_HQ, BLOCK)
    _rotate_heads(k_ptr + t * stride_kt, k_out_ptr + t * HKV * (2 * HALF), stride_kh, HKV, cos, sin,
                  HALF, BLOCK_HKV, BLOCK)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
           sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` at ``positions [T]``, in one launch.

    ``q``/``k`` may be strided views (e.g. of the fused qkv projection's output); they are not
    written. ``cos_cache``/``sin_cache``: ``[P, D/2]`` float32; positions must be ``< P`` (not
    checked: a check would need a host sync). Returns new contiguous rotated ``q``, ``k``.
    """
    T, hq, d = q.shape
    hkv = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if T == 0:
        return q_out, k_out
    half = d // 2
    block, block_hq = _next_pow2(half), _next_pow2(hq)
    _rotary_kernel[(T,)](
        q, k, q_out, k_out, positions, cos_cache, sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_cache.stride(0),
        hq, hkv,
        HALF=half, BLOCK_HQ=block_hq, BLOCK_HKV=_next_pow2(hkv), BLOCK=block,
        num_warps=min(8, max(1, block_hq * block // 256)), enable_fp_fusion=False, **pdl_launch(q.device),
    )
    return q_out, k_out


# ------------------------------------------------------------------------------------------------
# Per-head RMSNorm of q and k, then RoPE
# ------------------------------------------------------------------------------------------------


def qk_norm_rotary_supported(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                             k_weight: torch.Tensor, gemma: bool = False) -> bool:
    """Whether ``qk_norm_rotary`` handles these operands (else norm and rotate separately).

    As for ``fused_add_rms_norm``, Llama's norm needs weights in the activation dtype (Gemma's
    computes in float32 whatever they are)."""
    d = q.shape[-1] if q.dim() == 3 else 0
    return (rotary_supported(positions, q, k) and q_weight.shape == (d,) and k_weight.shape == (d,)
            and q_weight.dtype == k_weight.dtype and (gemma or q_weight.dtype == q.dtype)
            and _next_pow2(d) <= _MAX_NORM_BLOCK)


@_jit
def norm_rotate_head(src, w_ptr, eps, pos, cos_ptr, sin_ptr, stride_cos, D, dtype: tl.constexpr,
                     HALF: tl.constexpr, BLOCK: tl.constexpr, BLOCK_HALF: tl.constexpr, NORM: tl.constexpr,
                     GEMMA: tl.constexpr):
    """One head (``D`` values at ``src``) at position ``pos``: RMSNorm'd (``NORM``; weights at
    ``w_ptr``) then rotated, as the two halves ``(out1, out2)``, float32 ``[BLOCK_HALF]`` holding
    ``dtype`` values. The norm is ``_add_rms_norm_kernel``'s for one head (the same row load and
    float32 sum of squares, in the same layout when launched with the same warps: the same bits);
    the two halves are then normalised again elementwise from the same rstd and rotated as
    ``_rotate_heads`` does. ``GEMMA``: Gemma's norm, ``normalise(x) * (1 + w)`` in float32,
    rounded once. :func:`qk_norm_rotary` and the paged attention's RoPE-and-store kernel
    (``plugins/attention/triton_kernels.py``) share it, so the two give the same bits."""
    d = tl.arange(0, BLOCK_HALF)
    mask = d < HALF
    x1 = tl.load(src + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + d, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        cols = tl.arange(0, BLOCK)
        row = tl.load(src + cols, mask=cols < D, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(row * row, axis=0) / D + eps)
        w1 = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + d, mask=mask, other=0.0).to(tl.float32)
        if GEMMA:
            n1 = _round(x1 * rstd * (1.0 + w1), dtype)
            n2 = _round(x2 * rstd * (1.0 + w2), dtype)
        else:  # HF: the normalised value rounded, then the weight's product rounded
            n1 = _round(w1 * _round(x1 * rstd, dtype), dtype)
            n2 = _round(w2 * _round(x2 * rstd, dtype), dtype)
    else:
        n1 = x1
        n2 = x2
    cos = _round(tl.load(cos_ptr + pos * stride_cos + d, mask=mask, other=0.0), dtype)
    sin = _round(tl.load(sin_ptr + pos * stride_cos + d, mask=mask, other=0.0), dtype)
    out1 = _round(n1 * cos, dtype) - _round(n2 * sin, dtype)
    out2 = _round(n2 * cos, dtype) + _round(n1 * sin, dtype)
    return out1, out2


@_jit
def _qk_norm_rotary_kernel(
    q_ptr, k_ptr,  # [T, Hq, D] and [T, Hkv, D] views, unit stride along D
    q_out_ptr, k_out_ptr,  # the same shapes, contiguous
    qw_ptr, kw_ptr,  # [D] norm weights
    pos_ptr,  # [T] integer positions
    cos_ptr, sin_ptr,  # [P, D/2] float32 tables
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos,
    HQ, HKV, D, q_eps, k_eps,
    HALF: tl.constexpr, BLOCK: tl.constexpr, BLOCK_HALF: tl.constexpr, GEMMA: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    # Program (t, h) normalises and rotates head h of token t: q heads first, then k heads
    # (norm_rotate_head).
    if USE_PDL:  # q and k come from the qkv projection
        pdl_prologue()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if h < HQ:
        src = q_ptr + t * stride_qt + h * stride_qh
        dst = q_out_ptr + (t * HQ + h) * D
        w_ptr = qw_ptr
        eps = q_eps
    else:
        src = k_ptr + t * stride_kt + (h - HQ) * stride_kh
        dst = k_out_ptr + (t * HKV + (h - HQ)) * D
        w_ptr = kw_ptr
        eps = k_eps
    dtype = q_out_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + t).to(tl.int64)
    out1, out2 = norm_rotate_head(src, w_ptr, eps, pos, cos_ptr, sin_ptr, stride_cos, D, dtype,
                                  HALF, BLOCK, BLOCK_HALF, True, GEMMA)
    d = tl.arange(0, BLOCK_HALF)
    mask = d < HALF
    tl.store(dst + d, out1.to(dtype), mask=mask)
    tl.store(dst + HALF + d, out2.to(dtype), mask=mask)


def qk_norm_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                   k_weight: torch.Tensor, q_eps: float, k_eps: float, cos_cache: torch.Tensor,
                   sin_cache: torch.Tensor, gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of every head of ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` (weights ``[D]``), then
    RoPE at ``positions [T]``, in one launch: ``rotary(positions, q_norm(q), k_norm(k))``.

    ``gemma``: Gemma's norm (``(1 + w)``, float32 throughout). ``q``/``k`` may be strided views
    of the qkv projection's output; they are not written. Returns new contiguous ``q``, ``k``.
    """
    T, hq, d = q.shape
    hkv = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if T == 0:
        return q_out, k_out
    half = d // 2
    block = _next_pow2(d)
    _qk_norm_rotary_kernel[(T, hq + hkv)](
        q, k, q_out, k_out, q_weight, k_weight, positions, cos_cache, sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_cache.stride(0),
        hq, hkv, d, q_eps, k_eps,
        HALF=half, BLOCK=block, BLOCK_HALF=_next_pow2(half), GEMMA=gemma,
        num_warps=norm_warps(block), enable_fp_fusion=False, **pdl_launch(q.device),
    )
    return q_out, k_out


# ------------------------------------------------------------------------------------------------
# SiLU-and-multiply
# ------------------------------------------------------------------------------------------------

_SILU_BLOCK = 1024


def silu_and_mul_supported(x: torch.Tensor) -> bool:
    """Whether ``silu_and_mul`` handles ``x`` (else use the torch path)."""
    return enabled(x) and x.dim() >= 1 and x.shape[-1] % 2 == 0 and x.stride(-1) == 1


@_jit
def _silu_mul_values(row_ptr, cols, mask, INTER, dtype: tl.constexpr):
    """``silu(gate) * up`` at ``cols`` of one ``[gate | up]`` row, float32 values rounded to ``dtype``
    (masked columns 0)."""
    gate = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row_ptr + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    # torch's silu: x / (1 + exp(-x)) in float32, then rounded. The accurate expf and an IEEE
    # division (tl.exp and `/` are approximate on GPUs) make it bit-identical to torch's kernel.
    act = _round(tl.math.div_rn(gate, 1.0 + libdevice.exp(-gate)), dtype)
    return _round(act * up, dtype)


@_jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_xt, INTER, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    # x: [T, 2*INTER] rows holding [gate | up]; out: [T, INTER] contiguous. Grid (T, column tiles).
    if USE_PDL:  # x comes from the gate/up projection
        pdl_prologue()
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    dtype = out_ptr.dtype.element_ty
    y = _silu_mul_values(x_ptr + t * stride_xt, cols, mask, INTER, dtype)
    tl.store(out_ptr + t * INTER + cols, y.to(dtype), mask=mask)


@_jit
def _silu_and_mul_quant_kernel(x_ptr, q_ptr, scale_ptr, static_ptr, stride_xt, INTER, STATIC: tl.constexpr,
                               BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, USE_PDL: tl.constexpr = False):
    # x: [T, 2*INTER] rows holding [gate | up]; q: [T, INTER] e4m3 contiguous; scale: [T] float32.
    # One program a row: _silu_and_mul_kernel's values quantized as the FP8 layer taking them
    # would (fp8_triton.quantize_rows). ONE_PASS: the whole row in one block; else two passes over
    # it, the first for its max |y| (the values computed twice, the same bits both times).
    if USE_PDL:
        pdl_prologue()
    t = tl.program_id(0).to(tl.int64)
    row = x_ptr + t * stride_xt
    dtype = x_ptr.dtype.element_ty
    if ONE_PASS:
        cols = tl.arange(0, BLOCK)
        mask = cols < INTER
        y = _silu_mul_values(row, cols, mask, INTER, dtype)
        _quantize_row_store(y, cols, mask, q_ptr + t * INTER, scale_ptr + t, static_ptr, STATIC)
    else:
        if STATIC:
            scale = tl.load(static_ptr).to(tl.float32)
        else:
            amax = tl.zeros((BLOCK,), dtype=tl.float32)
            for c0 in range(0, INTER, BLOCK):
                cols = c0 + tl.arange(0, BLOCK)
                amax = tl.maximum(amax, tl.abs(_silu_mul_values(row, cols, cols < INTER, INTER, dtype)))
            scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), 448.0), 1e-12)
        for c0 in range(0, INTER, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            mask = cols < INTER
            y = _silu_mul_values(row, cols, mask, INTER, dtype)
            q = tl.clamp(tl.math.div_rn(y, scale), -448.0, 448.0)
            tl.store(q_ptr + t * INTER + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + t, scale)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x [..., 2*I]`` holding ``[gate | up]`` -> new ``[..., I]``."""
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])  # [T, 2*I]; a view for the usual contiguous input
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if out.numel() > 0:
        grid = (x2.shape[0], triton.cdiv(inter, _SILU_BLOCK))
        _silu_and_mul_kernel[grid](x2, out, x2.stride(0), inter, BLOCK=_SILU_BLOCK, num_warps=4,
                                   enable_fp_fusion=False, **pdl_launch(x.device))
    return out.view(*x.shape[:-1], inter)


# Its launch: rows of up to 2,048 in one block, wider ones in two passes of 2,048-column blocks, 8
# warps. Measured on an H100 (scripts/bench_fused_input.py, llama-8b's I = 14,336; the kernel and
# the separate silu + quantize_rows, us): the whole row in one 16,384-wide block with 16 warps took
# 16.6 / 131 / 1,006 at 256 / 2,048 / 16,384 tokens against 12.3 / 100 / 727 for the two kernels
# (127 registers a thread compiled for sm_90: one 512-thread program fills an SM's register file);
# two passes of 2,048 x 8 warps (51 registers) 12.9 / 93 / 670.
_SILU_QUANT_BLOCK = 2048
_SILU_QUANT_WARPS = 8


def silu_and_mul_quant(x: torch.Tensor, static_scale: torch.Tensor | None, *, block: int | None = None,
                       warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu_and_mul`` of ``x [..., 2*I]`` quantized to e4m3 as ``fp8_triton.quantize_rows`` would
    quantize its output (the same codes and scales, bit for bit): ``(codes [T, I], scales [T, 1])``,
    ``T`` the rows of ``x``. ``static_scale``: ``[1]`` float32 for every row, or None (per row).
    ``block`` / ``warps``: another launch than the rule's (measurements: a block narrower than the
    row takes the two-pass form)."""
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    codes = torch.empty((rows, inter), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows and inter:
        if block is None:
            block = min(_SILU_QUANT_BLOCK, _next_pow2(inter))
            warps = warps or min(_SILU_QUANT_WARPS, norm_warps(block))
        one_pass = block >= inter
        _silu_and_mul_quant_kernel[(rows,)](x2, codes, scales, static_scale if static_scale is not None else scales,
                                            x2.stride(0), inter, STATIC=static_scale is not None, BLOCK=block,
                                            ONE_PASS=one_pass, num_warps=warps or norm_warps(block),
                                            enable_fp_fusion=False, **pdl_launch(x.device))
    return codes, scales
