"""Attention over the FP8 KV pool (``--kv-cache-dtype fp8``): the ``paged`` backend's kernel for
packed pools, with half-precision dots on the codes and no per-byte shared-memory traffic.

The pool (``loom.plugin_api.kv_fp8``) holds e4m3 codes and a float32 scale per (token, KV head):
key codes ``[num_blocks, page, Hkv, D]`` (a key's row contiguous), value codes ``[num_blocks,
Hkv, D, page]`` (a value element's tokens contiguous), scales ``[num_blocks, page, Hkv]``. The
generic kernel (``triton_kernels._paged_attn_kernel`` with ``FP8_KV``) converts every code to the
query's dtype through float32 and feeds bf16 dots; compiled for sm_90 its key loop costs 8.37
instructions a K/V element against 3.63 over a bf16 pool (``scripts/paged_sass.py``): half the
bytes at 2.3 times the instructions, so decode over FP8 was slower than over bf16. This kernel
differs in four ways, each counted with the same script:

* **fp16 dots.** Triton runs dots on e4m3 operands of sm_90 as fp16 ``mma`` anyway, and
  ``F2FP.F16.E4M3.UNPACK_B`` turns two codes into two fp16 values in one instruction, exactly;
  reaching bf16 costs two more (through float32). So both dots run in fp16 whatever the model's
  dtype: the query is scaled per row by a power of two that brings its largest magnitude to
  ``[2**14, 2**15)``, below fp16's 65504 (every bf16 value of the row down to ``2**-32`` of the
  largest then converts to fp16 exactly, smaller ones to within ``2**-39`` of it; the power of
  two comes back exactly with the scores), and the probabilities, in ``[0, 1]``, are rounded to
  fp16 (11 bits, where the generic kernel rounds them to bf16's 8).
* **transposed dots.** The kernel computes ``S^T = K Q^T`` and ``O^T = V^T P^T``: the codes are
  the dots' first operand and the query rows their second, so a decode tile needs only ``N = 8``
  query rows (the ``G`` heads of one KV head, padded to the tensor core's smallest width)
  instead of 16 rows as the first operand. The softmax runs over axis 0.
* **value codes token-contiguous.** ``P.V`` reduces over the tokens, and the tensor cores want
  the reduced dimension contiguous: bf16 tiles are transposed by ``ldmatrix`` on the way, bytes
  cannot be, and the generic kernel read values one byte per load. The pool stores values
  transposed, so ``V^T`` tiles load like ``K`` tiles (``cp.async`` of 16 bytes, then ``ldmatrix``).
* **one warp per decode program**, the key tile read a page at a time: the row maxima and sums
  are warp shuffles, with no shared-memory round trip between warps, and a tile's addresses
  come from one block-table entry per page instead of one per key.

Compiled for sm_90 (decode, G = 4, head size 128, 64-key tiles; ``scripts/paged_sass.py``): 1.91
instructions a K/V element and 167 registers, against 8.37 and 195 for the generic kernel over
the token-major pool of 2026-12-02 and 3.63 and 126 over bf16: per *byte* read, what the bf16
kernel issues (1.85 against 1.82).

Launch plans (``fp8_decode_plans``, a measured table; today's launch while it is empty): the key
tile, warps, stages, a register cap (``maxnreg``) and ``PREFETCH_TABLE``, which loads each tile's
block-table entries one iteration ahead: Triton's pipeliner otherwise keeps the K/V tiles in one
shared buffer (their addresses depend on a load of the same iteration), and with it gives them
two. None of these changes the arithmetic.

Scales: each key's scale times the row's query scale multiplies its score; each value's scale,
divided by a power of two at or above the tile's largest, multiplies its column of
probabilities before the fp16 rounding (so the rounded values stay in ``[0, 1]``), and the
accumulator is kept in units of that power of two, rescaled exactly when it changes. ``l`` sums
the unscaled probabilities. Float32 activations (tests, reference runs) keep float32 IEEE dots.

A key tile starts on a multiple of ``BLOCK_N`` (a window's first key rounded down, the keys
before it masked), so it covers whole pages, or part of one page when pages are longer than a
tile. Keys past the sequence inside its last page are read but masked (their scores are
``-inf``, their value scales 0, so their probabilities times their codes are 0: ``store_kv``
never writes a NaN code, since its clamps drop NaN); pages past it are not read.
"""

# mypy: disable-error-code="no-untyped-def"
# (Triton kernels take untyped pointer arguments; annotations there would change their meaning.)
from __future__ import annotations

import torch
import triton
import triton.language as tl

from loom.layers.triton_jit import pdl_launch, pdl_prologue
from loom.plugin_api import kv_fp8

from .triton_kernels import _LOG2E, _merge_splits, _next_pow2, _program_sequence, _tile_rows


@triton.jit
def _paged_attn_fp8_kernel(
    q_ptr,  # [T, Hq, D] bf16 / fp16 / fp32
    kc_ptr,  # [num_blocks, page, Hkv, D] e4m3 key codes (a row contiguous)
    vc_ptr,  # [num_blocks, Hkv, D, page] e4m3 value codes (tokens contiguous)
    ks_ptr, vs_ptr,  # [num_blocks, page, Hkv] float32 scales
    out_ptr,  # [T, Hq, D] (written when NUM_SPLITS == 1)
    part_o_ptr,  # [n, Hq, NUM_SPLITS, BLOCK_D] fp32 (written when NUM_SPLITS > 1)
    part_lse_ptr,  # [n, Hq, NUM_SPLITS] fp32, log2 domain
    qsl_ptr,  # [B + 1] int32 query_start_loc
    seq_lens_ptr,  # [B] int32
    bt_ptr,  # [B, max_blocks] int32 block tables
    seq_ids_ptr,  # [n] int32: which sequences this launch serves (when HAS_SEQ_IDS)
    qk_scale,  # softmax scale * log2(e); the softmax scale alone with HAS_SOFT_CAP
    window,  # sliding window (keys p > q_pos - window), used when HAS_WINDOW
    soft_cap,  # score soft cap, used when HAS_SOFT_CAP
    num_q_heads,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vch, stride_vcd,
    stride_sb, stride_ss, stride_sh,
    stride_bt,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    TILE_PAGES: tl.constexpr, TILE_W: tl.constexpr,  # a key tile: TILE_PAGES pages of TILE_W keys
    NUM_SPLITS: tl.constexpr, HAS_SEQ_IDS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr, F32_DOTS: tl.constexpr,
    PREFETCH_TABLE: tl.constexpr = False,  # load each tile's block-table entries one iteration ahead
    USE_PDL: tl.constexpr = False,
):
    if USE_PDL:  # q, and the codes store_kv just wrote to the pool, come from the kernels before
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
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_D]
        if F32_DOTS:
            q_t = tl.trans(q)  # [BLOCK_D, BLOCK_M]
            q_scale = tl.full([BLOCK_M], 1.0, tl.float32) * qk_scale
        else:
            # Each row times 2**(141 - e), e the biased exponent of its largest |q|: that value
            # lands in [2**14, 2**15), below fp16's 65504, and the scores take 2**(e - 141) back.
            # Both factors are built from their exponent bits, so both products are exact. An
            # all-zero row gets 2**127 and 0.
            amax = tl.max(tl.abs(q), 1)  # [BLOCK_M]
            e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
            up = tl.minimum(tl.maximum(268 - e, 1), 254)  # biased exponent of the factor
            q_t = tl.trans((q * (up << 23).to(tl.float32, bitcast=True)[:, None]).to(tl.float16))
            q_scale = ((254 - up) << 23).to(tl.float32, bitcast=True) * qk_scale  # [BLOCK_M]

        # Keys this tile can see: up to its last token, from the window of its first token,
        # the start rounded down to a whole tile.
        hi = ctx_len + tl.minimum(q_len, tok0 + TOK)
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(ctx_len + tok0 - window + 1, 0) // BLOCK_N * BLOCK_N
        per_split = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), NUM_SPLITS), BLOCK_N) * BLOCK_N
        s_lo = lo + split * per_split
        s_hi = tl.minimum(hi, s_lo + per_split)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc_t = tl.zeros([BLOCK_D, BLOCK_M], tl.float32)  # O^T, in units of v_unit
        v_unit = tl.full([], 1.0, tl.float32)  # a power of two: the value scales' unit of the last tile
        bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
        pg = tl.arange(0, TILE_PAGES)
        w = tl.arange(0, TILE_W)
        if PREFETCH_TABLE:  # the first tile's pages; each iteration then loads the next tile's
            blk_next = tl.load(bt_row + s_lo // PAGE + pg, mask=s_lo + pg * TILE_W < s_hi, other=0).to(tl.int64)
        else:
            blk_next = tl.zeros([TILE_PAGES], tl.int64)
        for start in range(s_lo, s_hi, BLOCK_N):
            page_ok = start + pg * TILE_W < s_hi  # [TILE_PAGES]
            if PREFETCH_TABLE:
                # The tile's pages came from the last iteration, so its K/V addresses depend on no
                # load of this one: Triton's pipeliner then gives K/V num_stages - 1 buffers (one
                # otherwise). The next tile's entries past the keys are masked (not read).
                blk = blk_next
                nxt = start + BLOCK_N
                blk_next = tl.load(bt_row + nxt // PAGE + pg, mask=nxt + pg * TILE_W < s_hi, other=0).to(tl.int64)
            else:
                blk = tl.load(bt_row + start // PAGE + pg, mask=page_ok, other=0).to(tl.int64)  # [TILE_PAGES]
            if TILE_PAGES > 1:  # noqa: SIM108 (a constexpr branch) whole pages: a tile starts on one
                slot = w  # [TILE_W] token within its page
            else:  # a part of one page; tiles start on multiples of BLOCK_N (the hint keeps the
                # token runs' copies wide)
                slot = tl.multiple_of(start % PAGE, BLOCK_N) + w
            key_ok = start + pg[:, None] * TILE_W + w[None, :] < s_hi  # [TILE_PAGES, TILE_W]
            kpos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N], the tile's keys page by page
            k_ok = kpos < s_hi
            # K tile [TILE_PAGES, TILE_W, BLOCK_D] -> [BLOCK_N, BLOCK_D]: rows of D bytes
            k_ptrs = (kc_ptr + (blk * stride_kcb + kvh * stride_kch)[:, None, None]
                      + (slot * stride_kcs)[None, :, None] + d[None, None, :])
            kt = tl.reshape(tl.load(k_ptrs, mask=page_ok[:, None, None] & d_ok[None, None, :], other=0.0),
                            [BLOCK_N, BLOCK_D])
            s_off = (blk * stride_sb + kvh * stride_sh)[:, None] + (slot * stride_ss)[None, :]
            k_scale = tl.reshape(tl.load(ks_ptr + s_off, mask=key_ok, other=0.0), [BLOCK_N])
            if F32_DOTS:
                s = tl.dot(kt.to(tl.float32), q_t, input_precision="ieee")  # [BLOCK_N, BLOCK_M]
            else:
                s = tl.dot(kt.to(tl.float16), q_t)  # codes -> fp16 exactly
            s = s * (k_scale[:, None] * q_scale[None, :])
            if HAS_SOFT_CAP:  # cap * tanh(s / cap), then into the log2 domain
                s = soft_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap) + 1.0)) * 1.4426950408889634
            ok = k_ok[:, None] & (kpos[:, None] <= q_pos[None, :])
            if HAS_WINDOW:
                ok = ok & (kpos[:, None] > q_pos[None, :] - window)
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            # A row with no visible key yet keeps m = -inf; subtract 0 then so exp2 gives 0, not NaN.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[None, :])  # [BLOCK_N, BLOCK_M]
            alpha = tl.exp2(m_i - m_safe)  # [BLOCK_M]
            l_i = l_i * alpha + tl.sum(p, 0)
            # V^T tile [BLOCK_D, TILE_PAGES, TILE_W] -> [BLOCK_D, BLOCK_N]: runs of TILE_W tokens
            v_ptrs = (vc_ptr + (blk * stride_vcb + kvh * stride_vch)[None, :, None]
                      + (d * stride_vcd)[:, None, None] + slot[None, None, :])
            vt = tl.reshape(tl.load(v_ptrs, mask=d_ok[:, None, None] & page_ok[None, :, None], other=0.0),
                            [BLOCK_D, BLOCK_N])
            v_scale = tl.reshape(tl.load(vs_ptr + s_off, mask=key_ok, other=0.0), [BLOCK_N])
            # The tile's unit: the power of two at or above its largest value scale (the exponent
            # rounded up by carrying the mantissa), or the last unit when every scale is 0.
            v_max = tl.max(v_scale, 0)
            unit_bits = (v_max.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000
            unit_bits = tl.where(v_max > 0.0, unit_bits, v_unit.to(tl.int32, bitcast=True))
            inv_unit = (0x7F000000 - unit_bits).to(tl.float32, bitcast=True)  # 1 / unit, exactly
            pv = p * (v_scale * inv_unit)[:, None]  # [BLOCK_N, BLOCK_M], in [0, 1]
            acc_t = acc_t * (alpha * (v_unit * inv_unit))[None, :]
            if F32_DOTS:
                acc_t = tl.dot(vt.to(tl.float32), pv, acc_t, input_precision="ieee")
            else:
                acc_t = tl.dot(vt.to(tl.float16), pv.to(tl.float16), acc_t)
            v_unit = unit_bits.to(tl.float32, bitcast=True)
            m_i = m_new

        has = l_i > 0.0
        o = tl.trans(acc_t * (v_unit / tl.where(has, l_i, 1.0))[None, :])  # [BLOCK_M, BLOCK_D]; padding 0
        if NUM_SPLITS == 1:
            tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        else:
            # Decode only (one token): row r is head kvh * GROUP + r.
            part = (i.to(tl.int64) * num_q_heads + head) * NUM_SPLITS + split  # [BLOCK_M]
            tl.store(part_o_ptr + part[:, None] * BLOCK_D + d[None, :], o, mask=row_ok[:, None])
            lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            tl.store(part_lse_ptr + part, lse, mask=row_ok)


@triton.jit
def _combine_fp8_kernel(
    out_ptr, part_o_ptr, part_lse_ptr, qsl_ptr, seq_ids_ptr, num_q_heads,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr, HAS_SEQ_IDS: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    # One program: one (sequence, query head). Every one of the kernel's NUM_SPLITS splits wrote
    # a partial (an empty one with log-sum-exp -inf, weighing 0), so all are merged: this kernel
    # cuts its key range its own way (the window's start rounded down to a tile), not by the
    # generic kernel's ``_split_share``.
    if USE_PDL:  # the partial outputs come from the attention kernel
        pdl_prologue()
    i = tl.program_id(0)
    h = tl.program_id(1)
    if HAS_SEQ_IDS:  # noqa: SIM108 (a constexpr branch, kept as a plain if for Triton)
        seq = tl.load(seq_ids_ptr + i)
    else:
        seq = i
    row = tl.load(qsl_ptr + seq).to(tl.int64)
    _merge_splits(out_ptr, part_o_ptr, part_lse_ptr, row, h, (i.to(tl.int64) * num_q_heads + h) * NUM_SPLITS,
                  NUM_SPLITS, stride_ot, stride_oh, HEAD_DIM, BLOCK_D, BLOCK_S, "")


def fp8_launch_config(group: int, head_dim: int, max_query_len: int, f32_dots: bool = False) -> dict[str, int]:
    """Tile sizes and warps of a launch: decode tiles hold one token's ``G`` heads (at least 8
    rows, the tensor core's smallest width) in one warp; longer queries take 64-row tiles in
    four warps. Heads above 128 halve the key tile (shared memory). Float32 dots (no tensor
    cores) spread a decode tile over four warps: one would spill."""
    block_d = _next_pow2(head_dim)
    block_n = 64 if block_d <= 128 else 32
    if max_query_len == 1:
        block_m = max(8, _next_pow2(group))
        return {"block_m": block_m, "block_n": block_n, "num_warps": 1 if block_m <= 16 and not f32_dots else 4}
    return {"block_m": max(64, _next_pow2(group)), "block_n": block_n, "num_warps": 4 if block_d <= 128 else 8}


def paged_attention_fp8(
    q: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # packed FP8 pool [2, num_blocks, page, Hkv, D + 4] uint8
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
    max_registers: int | None = None,  # Triton's maxnreg: registers a thread at most (ptxas spills the rest)
    prefetch_table: bool = False,  # the kernel's PREFETCH_TABLE (same loads, same results)
) -> None:
    """``triton_kernels.paged_attention`` over a packed FP8 pool, through this module's kernel."""
    if num_seqs == 0:
        return
    _, hq, d = q.shape
    page, hkv = kv_cache.shape[2], kv_cache.shape[3]
    group = hq // hkv
    if num_splits > 1 and max_query_len != 1:
        raise ValueError("split-K is only for decode (one query token per sequence)")
    cfg = fp8_launch_config(group, d, max_query_len, q.dtype == torch.float32)
    block_m = block_m or cfg["block_m"]
    block_n = block_n or cfg["block_n"]
    block_d = _next_pow2(d)
    m_tiles = triton.cdiv(max_query_len, block_m // group)
    kc, vc, ks, vs = kv_fp8.views(kv_cache)
    if num_splits > 1:
        part_o = torch.empty((num_seqs, hq, num_splits, block_d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_seqs, hq, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    ids = seq_ids if seq_ids is not None else query_start_loc  # unused when HAS_SEQ_IDS is False
    extra = {"num_warps": num_warps or cfg["num_warps"]}
    if num_stages is not None:
        extra["num_stages"] = num_stages
    if max_registers is not None:  # (the interpreter ignores it)
        extra["maxnreg"] = max_registers
    _paged_attn_fp8_kernel[(num_seqs, hkv, m_tiles * num_splits)](
        q, kc, vc, ks, vs, out, part_o, part_lse,
        query_start_loc, seq_lens, block_tables, ids,
        scale if logits_soft_cap is not None else scale * _LOG2E, sliding_window or 0, logits_soft_cap or 0.0, hq,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2),
        vc.stride(0), vc.stride(2), vc.stride(3),
        ks.stride(0), ks.stride(1), ks.stride(2),
        block_tables.stride(0),
        HEAD_DIM=d, BLOCK_D=block_d, GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, PAGE=page,
        TILE_PAGES=max(1, block_n // page), TILE_W=min(block_n, page),
        NUM_SPLITS=num_splits, HAS_SEQ_IDS=seq_ids is not None,
        HAS_WINDOW=sliding_window is not None, HAS_SOFT_CAP=logits_soft_cap is not None,
        F32_DOTS=q.dtype == torch.float32, PREFETCH_TABLE=prefetch_table,
        **extra, **pdl_launch(q.device),
    )
    if num_splits > 1:
        _combine_fp8_kernel[(num_seqs, hq)](
            out, part_o, part_lse, query_start_loc, ids, hq,
            out.stride(0), out.stride(1),
            HEAD_DIM=d, BLOCK_D=block_d, NUM_SPLITS=num_splits, BLOCK_S=_next_pow2(num_splits),
            HAS_SEQ_IDS=seq_ids is not None, **pdl_launch(q.device),
        )
