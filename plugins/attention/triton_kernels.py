"""Triton kernels of the ``paged`` attention backend, and thin launchers for them.

Two kernels and a reduction:

* ``store_kv``: writes each new token's K and V rows into the block pool at its slot, both in one
  launch (``index_copy_`` needs one launch each), and skips slots ``< 0``. The skip is what lets
  CUDA-graph padding rows run the model without touching the pool.
* ``paged_attention``: causal attention of varlen queries over keys read from the pool through
  the block tables. One program owns one (sequence, KV head, query tile, key split). Its query
  tile folds the ``G`` query heads that share the KV head into the row dimension (row ``r`` is
  token ``r // G``, head ``r % G``), so every K/V tile is loaded once for all of them. Decode is
  the case of one token: the tile is ``G`` rows (padded to 16 for the tensor cores).
* split-K (flash-decoding): for decode with few sequences, each sequence's key range is cut
  into at most ``NUM_SPLITS`` pieces of at least ``min_keys`` keys, handled by separate
  programs, each writing a partial output and its log-sum-exp; ``_combine_kernel`` merges them,
  or (``FUSED_COMBINE``) the last piece of each (sequence, KV head) to finish does, counted on an
  integer counter (``loom.layers.split_k.last_to_arrive``). A key range that fits one piece is
  written straight to the output. The cut is made inside the kernel from the device-side
  ``seq_lens``, so the grid depends only on host values fixed at launch (batch size, head
  count, split count) and the launch is CUDA-graph capturable; the merge reads the pieces in one
  fixed order whichever finished last (``decode_plans.py`` says which plan serves a step).
* the same holds for queries longer than one token: each program reads its sequence's query range
  and context length from the device-side ``query_start_loc`` and ``seq_lens``; the grid needs only
  ``num_seqs`` and an upper bound of the query lengths. A graph of sequences that all have ``q``
  tokens (draft verification on cached context) is captured with ``max_query_len = q``; its
  padding sequences (``seq_len`` 0, so ``ctx_len = -q``) see no key and write zeros.

Soft-capped scores (Gemma 2): with ``HAS_SOFT_CAP`` a score is ``cap * tanh(scale * q.k / cap)``
before the causal/window mask, the tanh computed as ``1 - 2 / (exp(2x) + 1)`` (exact at both
ends: the exponential saturates to 0 or inf).

Causality is aligned to the end of each sequence: sequence ``b`` has ``L = seq_lens[b]`` tokens of
which the last ``q = query_len`` are queries, query ``i`` sits at position ``L - q + i`` and sees
keys ``p <= L - q + i`` (and ``p > L - q + i - window`` with a sliding window). All keys, the new
ones included, are read from the pool, so ``store_kv`` must run first.

An FP8 pool (``--kv-cache-dtype fp8``, ``loom.plugin_api.kv_fp8``): ``store_kv`` quantizes each
(token, head) row to e4m3 codes and a float32 scale exactly as ``kv_fp8.quantize`` does (the
value codes token-contiguous, by their d stride). Attention over it normally runs the kernel of
``triton_fp8_attention.py``; the ``FP8_KV`` path here is its fallback (``LOOM_FP8_KV_KERNEL=0``):
it converts the codes to the query's dtype (exact), runs the dots on them, and applies the
scales per key: to the scores' columns (K) and to the probabilities' columns before the P.V dot
(V). The running sums of the softmax keep the unscaled probabilities.

Positions and slots are computed per key token (``block_tables[b, p // page] * page + p % page``),
so the key tile ``BLOCK_N`` is independent of the page size. Block offsets are widened to int64:
a large pool's per-layer tensor can pass 2**31 elements.
"""

# mypy: disable-error-code="no-untyped-def"
# (Triton kernels take untyped pointer arguments; annotations there would change their meaning.)
from __future__ import annotations

import torch
import triton
import triton.language as tl

from loom.layers.fused_ops import norm_rotate_head, norm_warps
from loom.layers.rotary import RopeArgs
from loom.layers.split_k import last_to_arrive
from loom.layers.triton_jit import pdl_launch, pdl_prologue
from loom.plugin_api import kv_fp8

# exp2/log2 are the fast hardware paths; scores are pre-multiplied by log2(e).
_LOG2E = 1.4426950408889634


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


# ------------------------------------------------------------------------------------------------
# K/V store
# ------------------------------------------------------------------------------------------------


@triton.jit
def _fp8_inv_scale(amax):
    """``kv_fp8.quantize``'s factors for rows of largest magnitude ``amax`` (float32, any shape):
    ``448 / amax`` (0 for a row of zeros) and the stored scale ``amax / 448``, both divisions
    correctly rounded (div_rn) to match torch's bytes."""
    fmax = tl.full(amax.shape, 448.0, tl.float32)
    inv = tl.where(amax > 0.0, tl.math.div_rn(fmax, tl.where(amax > 0.0, amax, 1.0)), 0.0)
    return inv, tl.math.div_rn(amax, fmax)


@triton.jit
def _fp8_codes(x, inv):
    """``x * inv`` clamped to e4m3's range, float32 (cast to the codes' dtype by the caller:
    round to nearest even)."""
    return tl.minimum(tl.maximum(x * inv, -448.0), 448.0)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr,  # [T, Hkv, D] (last dim contiguous)
    kc_ptr, vc_ptr,  # [num_blocks, page, Hkv, D] each (FP8: the codes' views of the packed pool)
    ks_ptr, vs_ptr,  # FP8 only: [num_blocks, page, Hkv] float32 scales (views of the same pool)
    slot_ptr,  # [T] int64; < 0 means "do not write"
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,  # V's d stride: 1, or the page for FP8 codes
    stride_sb, stride_ss, stride_sh,  # of ks / vs (the same layout for both)
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, FP8_KV: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    if USE_PDL:  # K and V come from the projection (and rotary); the pool's rows may be read before
        pdl_prologue()
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        blk = slot // PAGE
        off = slot % PAGE
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        h_ok = h < NUM_KV_HEADS
        mask = h_ok[:, None] & (d < HEAD_DIM)[None, :]
        t64 = t.to(tl.int64)
        k = tl.load(k_ptr + t64 * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(v_ptr + t64 * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        k_dst = kc_ptr + blk * stride_kcb + off * stride_kcs + h[:, None] * stride_kch + d[None, :]
        v_dst = vc_ptr + blk * stride_vcb + off * stride_vcs + h[:, None] * stride_vch + d[None, :] * stride_vcd
        if FP8_KV:
            # kv_fp8.quantize per (token, head) row: scale = max|x| / 448, codes = x * (448 / max|x|)
            # rounded to nearest even (_fp8_inv_scale, _fp8_codes).
            s_off = blk * stride_sb + off * stride_ss + h * stride_sh
            kf = k.to(tl.float32)
            k_inv, k_scale = _fp8_inv_scale(tl.max(tl.abs(kf), 1))  # [BLOCK_H] each
            tl.store(k_dst, _fp8_codes(kf, k_inv[:, None]).to(kc_ptr.dtype.element_ty), mask=mask)
            tl.store(ks_ptr + s_off, k_scale, mask=h_ok)
            vf = v.to(tl.float32)
            v_inv, v_scale = _fp8_inv_scale(tl.max(tl.abs(vf), 1))
            tl.store(v_dst, _fp8_codes(vf, v_inv[:, None]).to(vc_ptr.dtype.element_ty), mask=mask)
            tl.store(vs_ptr + s_off, v_scale, mask=h_ok)
        else:
            tl.store(k_dst, k, mask=mask)
            tl.store(v_dst, v, mask=mask)


@triton.jit
def _fp8_row_store(x1, x2, mask, dst, stride_d, HALF, scale_dst, code_dtype: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """One (token, head) row given as its two float32 halves, written as ``kv_fp8.quantize`` does
    (``_store_kv_kernel``'s arithmetic on one row: the same codes and scale)."""
    inv, scale = _fp8_inv_scale(tl.maximum(tl.max(tl.abs(x1), 0), tl.max(tl.abs(x2), 0)))
    d = tl.arange(0, BLOCK_HALF)
    tl.store(dst + d * stride_d, _fp8_codes(x1, inv).to(code_dtype), mask=mask)
    tl.store(dst + (HALF + d) * stride_d, _fp8_codes(x2, inv).to(code_dtype), mask=mask)
    tl.store(scale_dst, scale)


@triton.jit
def _rope_store_kernel(
    q_ptr, k_ptr, v_ptr,  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D] views, unit stride along D
    q_out_ptr,  # [T, Hq, D] contiguous
    qw_ptr, kw_ptr,  # [D] norm weights (NORM)
    pos_ptr,  # [T] integer positions
    cos_ptr, sin_ptr,  # [P, D/2] float32 tables
    kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr,  # the pool and the slots, as _store_kv_kernel's
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    stride_sb, stride_ss, stride_sh,
    HQ, D, q_eps, k_eps,
    HALF: tl.constexpr, BLOCK: tl.constexpr, BLOCK_HALF: tl.constexpr, NORM: tl.constexpr,
    GEMMA: tl.constexpr, PAGE: tl.constexpr, FP8_KV: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    # Program (t, h): head h of token t, q heads first. A q head is (normalised and) rotated
    # into q_out, as fused_ops.qk_norm_rotary / rotary compute it; KV head j = h - HQ has its K
    # row (normalised and) rotated and its V row written into the pool at the token's slot (slot
    # < 0: not written), as store_kv writes them: one launch for the RoPE and the store.
    if USE_PDL:  # q, k and v come from the qkv projection; the pool's rows may be read before
        pdl_prologue()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    dtype = q_out_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    mask = d < HALF
    if h < HQ:
        out1, out2 = norm_rotate_head(q_ptr + t * stride_qt + h * stride_qh, qw_ptr, q_eps, pos, cos_ptr, sin_ptr,
                                      stride_cos, D, dtype, HALF, BLOCK, BLOCK_HALF, NORM, GEMMA)
        dst = q_out_ptr + (t * HQ + h) * D
        tl.store(dst + d, out1.to(dtype), mask=mask)
        tl.store(dst + HALF + d, out2.to(dtype), mask=mask)
    else:
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            j = h - HQ
            blk = slot // PAGE
            off = slot % PAGE
            k1, k2 = norm_rotate_head(k_ptr + t * stride_kt + j * stride_kh, kw_ptr, k_eps, pos, cos_ptr, sin_ptr,
                                      stride_cos, D, dtype, HALF, BLOCK, BLOCK_HALF, NORM, GEMMA)
            v_src = v_ptr + t * stride_vt + j * stride_vh
            v1 = tl.load(v_src + d, mask=mask, other=0.0).to(tl.float32)
            v2 = tl.load(v_src + HALF + d, mask=mask, other=0.0).to(tl.float32)
            k_dst = kc_ptr + blk * stride_kcb + off * stride_kcs + j * stride_kch
            v_dst = vc_ptr + blk * stride_vcb + off * stride_vcs + j * stride_vch
            if FP8_KV:  # quantized from the rotated K as stored in the activations' dtype
                k1 = k1.to(dtype).to(tl.float32)
                k2 = k2.to(dtype).to(tl.float32)
                s_off = blk * stride_sb + off * stride_ss + j * stride_sh
                _fp8_row_store(k1, k2, mask, k_dst, 1, HALF, ks_ptr + s_off, kc_ptr.dtype.element_ty, BLOCK_HALF)
                _fp8_row_store(v1, v2, mask, v_dst, stride_vcd, HALF, vs_ptr + s_off, vc_ptr.dtype.element_ty,
                               BLOCK_HALF)
            else:
                tl.store(k_dst + d, k1.to(dtype), mask=mask)
                tl.store(k_dst + HALF + d, k2.to(dtype), mask=mask)
                tl.store(v_dst + d * stride_vcd, v1.to(dtype), mask=mask)
                tl.store(v_dst + (HALF + d) * stride_vcd, v2.to(dtype), mask=mask)


def rope_store(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, page, Hkv, D], or packed FP8 [..., D + 4] uint8
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    rope: RopeArgs,
) -> torch.Tensor:  # [T, Hq, D] contiguous: q rotated
    """RoPE of ``q`` and ``k`` (after their per-head norms, when ``rope`` has them) and the store
    of the rotated ``k`` and ``v`` into the pool, in one launch: ``rope.apply(q, k)`` then
    :func:`store_kv`, with the same bits (``fused_ops.norm_rotate_head`` is shared, and the FP8
    rows are quantized with ``_store_kv_kernel``'s arithmetic). Returns the rotated ``q``."""
    T, hq, d = q.shape
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if T == 0:
        return q_out
    kc, vc, ks, vs, fp8 = _pool_views(kv_cache)
    half, block = d // 2, _next_pow2(d)
    qw = rope.q_weight if rope.q_weight is not None else q
    kw = rope.k_weight if rope.k_weight is not None else q
    _rope_store_kernel[(T, hq + k.shape[1])](
        q, k, v, q_out, qw, kw, rope.positions, rope.cos, rope.sin, kc, vc, ks, vs, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), rope.cos.stride(0),
        kc.stride(0), kc.stride(1), kc.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2), vc.stride(3),
        ks.stride(0), ks.stride(1), ks.stride(2),
        hq, d, rope.q_eps, rope.k_eps,
        HALF=half, BLOCK=block, BLOCK_HALF=_next_pow2(half), NORM=rope.q_weight is not None, GEMMA=rope.gemma,
        PAGE=kv_cache.shape[2], FP8_KV=fp8, num_warps=norm_warps(block), enable_fp_fusion=False,
        **pdl_launch(q.device),
    )
    return q_out


def _pool_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """(K, V, K scales, V scales, is FP8) of a layer's pool: the packed FP8 pool's codes and
    scales (``kv_fp8.views``; V's codes token-contiguous, so their d stride is not 1), or a dense
    pool's halves (the scales then unused stand-ins)."""
    if kv_fp8.is_packed(kv_cache):
        return (*kv_fp8.views(kv_cache), True)
    return kv_cache[0], kv_cache[1], kv_cache[0], kv_cache[1], False


def store_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, page, Hkv, D], or packed FP8 [..., D + 4] uint8
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
) -> None:
    T, hkv, d = k.shape
    if T == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    kc, vc, ks, vs, fp8 = _pool_views(kv_cache)  # [num_blocks, page, Hkv, D] each; scales [.., Hkv]
    _store_kv_kernel[(T,)](
        k, v, kc, vc, ks, vs, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2), vc.stride(3),
        ks.stride(0), ks.stride(1), ks.stride(2),
        NUM_KV_HEADS=hkv, HEAD_DIM=d, BLOCK_H=_next_pow2(hkv), BLOCK_D=_next_pow2(d),
        PAGE=kv_cache.shape[2], FP8_KV=fp8, **pdl_launch(k.device),
    )


# ------------------------------------------------------------------------------------------------
# Attention
# ------------------------------------------------------------------------------------------------


@triton.jit
def _program_sequence(i, seq_ids_ptr, qsl_ptr, seq_lens_ptr, HAS_SEQ_IDS: tl.constexpr):
    """Program ``i``'s sequence (``seq_ids[i]``, or ``i``), where its queries start, how many
    there are, and its cached context (the keys before its first query)."""
    if HAS_SEQ_IDS:  # noqa: SIM108 (a constexpr branch, kept as a plain if for Triton)
        seq = tl.load(seq_ids_ptr + i)
    else:
        seq = i
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    return seq, q_start, q_len, seq_len - q_len


@triton.jit
def _tile_rows(kvh, tok0, q_start, q_len, ctx_len, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """A query tile's rows: ``BLOCK_M // GROUP`` tokens from ``tok0``, each with the ``GROUP``
    query heads of KV head ``kvh``. Returns each row's query head, validity, absolute position
    and output row ([BLOCK_M] each), and the head dimension's offsets and mask."""
    rows = tl.arange(0, BLOCK_M)
    tok = tok0 + rows // GROUP  # [BLOCK_M] token of the sequence's queries
    head = kvh * GROUP + rows % GROUP  # [BLOCK_M] query head
    row_ok = (rows < (BLOCK_M // GROUP) * GROUP) & (tok < q_len)
    q_pos = ctx_len + tok  # [BLOCK_M] absolute position of each row's token
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    return head, row_ok, q_pos, d, d_ok, q_rows


@triton.jit
def _paged_attn_kernel(
    q_ptr,  # [T, Hq, D]
    kc_ptr, vc_ptr,  # [num_blocks, page, Hkv, D] each (FP8: e4m3 codes, V's token-contiguous)
    ks_ptr, vs_ptr,  # FP8 only: [num_blocks, page, Hkv] float32 scale of each key's / value's row
    out_ptr,  # [T, Hq, D] (written when NUM_SPLITS == 1)
    part_o_ptr,  # [n, Hq, NUM_SPLITS, BLOCK_D] fp32 (written when NUM_SPLITS > 1)
    part_lse_ptr,  # [n, Hq, NUM_SPLITS] fp32, log2 domain
    qsl_ptr,  # [B + 1] int32 query_start_loc
    seq_lens_ptr,  # [B] int32
    bt_ptr,  # [B, max_blocks] int32 block tables
    seq_ids_ptr,  # [n] int32: which sequences this launch serves (when HAS_SEQ_IDS)
    counter_ptr,  # [>= n * Hkv] int32 zeros: arrivals of each (sequence, KV head)'s splits (FUSED_COMBINE)
    qk_scale,  # softmax scale * log2(e); the softmax scale alone with HAS_SOFT_CAP
    window,  # sliding window (keys p > q_pos - window), used when HAS_WINDOW
    soft_cap,  # score soft cap, used when HAS_SOFT_CAP
    num_q_heads,
    min_keys,  # split-K: the fewest keys a split takes (fewer splits for short contexts)
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,  # V's d stride: 1, or the page for FP8 codes
    stride_sb, stride_ss, stride_sh,
    stride_bt,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_SEQ_IDS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr, PRECISION: tl.constexpr, FP8_KV: tl.constexpr,
    FUSED_COMBINE: tl.constexpr, BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    if USE_PDL:  # q, and the keys store_kv just wrote to the pool, come from the kernels before
        pdl_prologue()
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    m_tile = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    seq, q_start, q_len, ctx_len = _program_sequence(i, seq_ids_ptr, qsl_ptr, seq_lens_ptr, HAS_SEQ_IDS)

    TOK = BLOCK_M // GROUP  # query tokens per tile (a constexpr)
    tok0 = m_tile * TOK
    if tok0 < q_len:
        head, row_ok, q_pos, d, d_ok, q_rows = _tile_rows(kvh, tok0, q_start, q_len, ctx_len, HEAD_DIM,
                                                         BLOCK_D, GROUP, BLOCK_M)
        q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

        # Keys this tile can see: up to its last token, from the window of its first token.
        hi = ctx_len + tl.minimum(q_len, tok0 + TOK)
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(ctx_len + tok0 - window + 1, 0)
        # This program's share of [lo, hi), in whole key tiles; later splits may get nothing.
        s_lo, s_hi, n_active = _split_share(lo, hi, split, min_keys, NUM_SPLITS, BLOCK_N)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
        for start in range(s_lo, s_hi, BLOCK_N):
            kpos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
            k_ok = kpos < s_hi
            if NUM_SPLITS > 1:
                # Key positions are never negative: divided as unsigned values the page and the
                # slot are a shift and a mask (signed, with a split's start the compiler cannot
                # bound, the split-K loop spent 40% more instructions; unsplit, the signed form
                # compiles shorter: docs/gpu-kernels.md).
                upos = kpos.to(tl.uint32)
                blk = tl.load(bt_row + (upos // PAGE).to(tl.int32), mask=k_ok, other=0).to(tl.int64)
                off = (upos % PAGE).to(tl.int32)
            else:
                blk = tl.load(bt_row + kpos // PAGE, mask=k_ok, other=0).to(tl.int64)
                off = kpos % PAGE
            k_addr = blk * stride_kcb + off * stride_kcs + kvh * stride_kch  # [BLOCK_N]
            kt = tl.load(kc_ptr + k_addr[:, None] + d[None, :],
                         mask=k_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
            s_addr = blk * stride_sb + off * stride_ss + kvh * stride_sh  # [BLOCK_N] (FP8 scales)
            if FP8_KV:
                # e4m3 codes are exact in fp16 / bf16: the dot runs on the codes, and each key's
                # scale multiplies its column of scores.
                k_scale = tl.load(ks_ptr + s_addr, mask=k_ok, other=0.0)  # [BLOCK_N] fp32
                kt = kt.to(tl.float32).to(q.dtype)
                s = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * (k_scale * qk_scale)[None, :]
            else:
                s = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N] fp32
            if HAS_SOFT_CAP:  # cap * tanh(s / cap), then into the log2 domain
                s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0)) * 1.4426950408889634
            ok = k_ok[None, :] & (kpos[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                ok = ok & (kpos[None, :] > q_pos[:, None] - window)
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row with no visible key yet keeps m = -inf; subtract 0 then so exp2 gives 0, not NaN.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
            alpha = tl.exp2(m_i - m_safe)  # [BLOCK_M]
            l_i = l_i * alpha + tl.sum(p, 1)
            v_addr = blk * stride_vcb + off * stride_vcs + kvh * stride_vch
            vt = tl.load(vc_ptr + v_addr[:, None] + d[None, :] * stride_vcd,
                         mask=k_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
            if FP8_KV:
                # each value row's scale folds into its column of probabilities (l_i keeps p)
                v_scale = tl.load(vs_ptr + s_addr, mask=k_ok, other=0.0)  # [BLOCK_N] fp32
                vt = vt.to(tl.float32).to(q.dtype)
                pv = p * v_scale[None, :]
                acc = acc * alpha[:, None] + tl.dot(pv.to(q.dtype), vt, input_precision=PRECISION)
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
            m_i = m_new

        has = l_i > 0.0
        o = acc / tl.where(has, l_i, 1.0)[:, None]  # rows with no key (padding) give 0
        if NUM_SPLITS == 1:
            tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        elif n_active == 1:  # one split holds every key: it writes the output, nothing to merge
            if split == 0:
                tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                         o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        elif split < n_active:
            # Decode only (one token): row r is head kvh * GROUP + r.
            part = (i.to(tl.int64) * num_q_heads + head) * NUM_SPLITS + split  # [BLOCK_M]
            tl.store(part_o_ptr + part[:, None] * BLOCK_D + d[None, :], o, mask=row_ok[:, None])
            lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            tl.store(part_lse_ptr + part, lse, mask=row_ok)
            if FUSED_COMBINE:  # noqa: SIM102 (a constexpr branch): the last split merges the G heads' partials
                if last_to_arrive(counter_ptr + i * (num_q_heads // GROUP) + kvh, n_active):
                    for g in tl.static_range(GROUP):
                        _merge_splits(out_ptr, part_o_ptr, part_lse_ptr, q_start.to(tl.int64), kvh * GROUP + g,
                                      (i.to(tl.int64) * num_q_heads + kvh * GROUP + g) * NUM_SPLITS, n_active,
                                      stride_ot, stride_oh, HEAD_DIM, BLOCK_D, BLOCK_S, ".cg")


@triton.jit
def _split_share(lo, hi, split, min_keys, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Split ``split``'s keys ``[s_lo, s_hi)`` of a key range ``[lo, hi)`` cut into at most
    NUM_SPLITS pieces of at least ``min_keys`` keys, in whole key tiles, and how many pieces hold
    keys (``n_active``, at least 1). With ``min_keys <= BLOCK_N`` the cut is the balanced one of
    NUM_SPLITS pieces; the later splits may get nothing."""
    n_keys = tl.maximum(hi - lo, 0)
    per_split = tl.maximum(tl.cdiv(tl.maximum(tl.cdiv(n_keys, NUM_SPLITS), min_keys), BLOCK_N) * BLOCK_N, BLOCK_N)
    n_active = tl.maximum(tl.cdiv(n_keys, per_split), 1)
    s_lo = lo + split * per_split
    return s_lo, tl.minimum(hi, s_lo + per_split), n_active


@triton.jit
def _merge_splits(out_ptr, part_o_ptr, part_lse_ptr, row, h, base, n_active, stride_ot, stride_oh,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, CACHE: tl.constexpr):
    """Output row ``row``, head ``h``: the ``n_active`` partial outputs at ``base`` merged by their
    log-sum-exp (empty splits weigh 0), every split read at once, summed in one fixed order."""
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    ok = s < n_active
    lse = tl.load(part_lse_ptr + base + s, mask=ok, other=float("-inf"), cache_modifier=CACHE)  # [BLOCK_S]
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)  # [BLOCK_S]
    o = tl.load(part_o_ptr + (base + s)[:, None] * BLOCK_D + d[None, :], mask=ok[:, None], other=0.0,
                cache_modifier=CACHE)  # [BLOCK_S, BLOCK_D]
    total = tl.sum(w, 0)
    res = tl.sum(o * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)  # [BLOCK_D]
    tl.store(out_ptr + row * stride_ot + h * stride_oh + d, res.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


@triton.jit
def _combine_kernel(
    out_ptr, part_o_ptr, part_lse_ptr, qsl_ptr, seq_lens_ptr, seq_ids_ptr, num_q_heads, window, min_keys,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SEQ_IDS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    # One program: one (sequence, query head) of a decode launch whose keys took several splits.
    if USE_PDL:  # the partial outputs come from the attention kernel
        pdl_prologue()
    i = tl.program_id(0)
    h = tl.program_id(1)
    if HAS_SEQ_IDS:  # noqa: SIM108 (a constexpr branch, kept as a plain if for Triton)
        seq = tl.load(seq_ids_ptr + i)
    else:
        seq = i
    row = tl.load(qsl_ptr + seq).to(tl.int64)
    # The decode key range the attention kernel cut: [lo, seq_len), the window's start or 0.
    hi = tl.load(seq_lens_ptr + seq)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(hi - window, 0)
    _, _, n_active = _split_share(lo, hi, 0, min_keys, NUM_SPLITS, BLOCK_N)
    if n_active > 1:  # else the one split wrote the output itself
        _merge_splits(out_ptr, part_o_ptr, part_lse_ptr, row, h, (i.to(tl.int64) * num_q_heads + h) * NUM_SPLITS,
                      n_active, stride_ot, stride_oh, HEAD_DIM, BLOCK_D, BLOCK_S, "")


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, page, Hkv, D], or packed FP8 [..., D + 4] uint8
    out: torch.Tensor,  # [T, Hq, D], written at the rows of the served sequences
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    *,
    num_seqs: int,  # n: sequences served (len(seq_ids), or the first n when seq_ids is None)
    seq_ids: torch.Tensor | None,  # [n] int32 or None (sequences 0..n-1)
    max_query_len: int,  # upper bound of the served sequences' query lengths
    scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None = None,
    num_splits: int = 1,  # > 1 only with max_query_len == 1 (decode)
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    min_keys: int = 0,  # split-K: the fewest keys a split takes (at most num_splits splits hold keys)
    counters: torch.Tensor | None = None,  # int32 zeros, >= num_seqs * Hkv: the last split merges
) -> None:
    """Attention of the served sequences' queries over their keys in the pool, into ``out``.

    Split-K (``num_splits > 1``, decode only): each (sequence, KV head)'s keys are cut into at most
    ``num_splits`` pieces of at least ``min_keys`` keys (counted on the device from its length,
    so a CUDA graph captured for a long bound still cuts a short context into few pieces); a key
    range that fits one piece is written straight to ``out``. The pieces are merged by a second
    launch, or, given ``counters``, by the last piece of each (sequence, KV head) to finish."""
    if num_seqs == 0:
        return
    _, hq, d = q.shape
    hkv = kv_cache.shape[3]
    group = hq // hkv
    if num_splits > 1 and max_query_len != 1:
        raise ValueError("split-K is only for decode (one query token per sequence)")
    if block_m is None:
        # Decode: one token's G heads (the dot needs >= 16 rows). Prefill: 64-row tiles.
        block_m = max(16, _next_pow2(group)) if max_query_len == 1 else max(64, _next_pow2(group))
    tok_per_tile = block_m // group
    m_tiles = triton.cdiv(max_query_len, tok_per_tile)
    block_d = _next_pow2(d)
    if block_d > 128:
        # Heads of 256 (Gemma 2): halve the key tile and pipeline two stages so K/V tiles fit
        # shared memory, and give a prefill tile's [64, 256] float32 accumulator eight warps.
        block_n = block_n or 32
        num_stages = num_stages or 2
        if max_query_len > 1:
            num_warps = num_warps or 8
    block_n = block_n or 64
    kc, vc, ks, vs, fp8 = _pool_views(kv_cache)
    if num_splits > 1:
        part_o = torch.empty((num_seqs, hq, num_splits, block_d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_seqs, hq, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    ids = seq_ids if seq_ids is not None else query_start_loc  # unused when HAS_SEQ_IDS is False
    fused = num_splits > 1 and counters is not None and counters.numel() >= num_seqs * hkv
    if min_keys % 16:  # keep the argument's specialisation the same for every value (no recompile)
        raise ValueError(f"min_keys must be a multiple of 16, got {min_keys}")
    extra: dict[str, int] = {}
    if num_warps is not None:
        extra["num_warps"] = num_warps
    if num_stages is not None:
        extra["num_stages"] = num_stages
    _paged_attn_kernel[(num_seqs, hkv, m_tiles * num_splits)](
        q, kc, vc, ks, vs, out, part_o, part_lse,
        query_start_loc, seq_lens, block_tables, ids, counters if fused else seq_lens,
        scale if logits_soft_cap is not None else scale * _LOG2E, sliding_window or 0, logits_soft_cap or 0.0, hq,
        min_keys,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2), vc.stride(3),
        ks.stride(0), ks.stride(1), ks.stride(2),
        block_tables.stride(0),
        HEAD_DIM=d, BLOCK_D=block_d, GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n,
        PAGE=kv_cache.shape[2], NUM_SPLITS=num_splits, HAS_SEQ_IDS=seq_ids is not None,
        HAS_WINDOW=sliding_window is not None, HAS_SOFT_CAP=logits_soft_cap is not None,
        # float32 caches (tests, reference runs) get IEEE dots, not TF32: their results then match
        # the CPU's to float32 rounding; half precision ignores the setting.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FP8_KV=fp8,
        FUSED_COMBINE=fused, BLOCK_S=_next_pow2(num_splits),
        **extra, **pdl_launch(q.device),
    )
    if num_splits > 1 and not fused:
        _combine_kernel[(num_seqs, hq)](
            out, part_o, part_lse, query_start_loc, seq_lens, ids, hq, sliding_window or 0, min_keys,
            out.stride(0), out.stride(1),
            HEAD_DIM=d, BLOCK_D=block_d, NUM_SPLITS=num_splits, BLOCK_S=_next_pow2(num_splits),
            BLOCK_N=block_n, HAS_SEQ_IDS=seq_ids is not None, HAS_WINDOW=sliding_window is not None,
            **pdl_launch(q.device),
        )
