"""The residual add + RMSNorm before an MoE block and its router (with the routing) in one launch
(CUDA, 1-4 tokens; #22).

At a decode step the post-attention norm (``fused_ops._add_rms_norm_kernel``: ``h = residual + x``,
``normed = rms_norm(h) * w``) and the router with its routing (``moe_router_gemv._router_route_kernel``:
``normed @ W^T`` with split K, the last split merging, the last tile routing) are two launches;
the norm is a few microseconds of launch and latency for 8 KB of work. Here the router's grid
does both: every program (pid_n, pid_s) recomputes the residual add and the sum of squares of
each token's whole row (2048 values: cheap, from L2), writes the normed values of its own split of
K into its tile's copy of the normed rows (tile 0's copy is the layer's normed output, and tile
0's programs also write the new residual), and then runs the router GEMV's tile on them with the
same code as ``_router_route_kernel`` (``gemv_tile`` and ``_merge_and_route``): the same loads,
dots, partial sums, merge and routing, so the same logits, weights and ids.

The normed rows are ``_add_rms_norm_kernel``'s bits. Every element is computed by the same
expressions (the add rounded to the dtype, ``variance = sum / H``, ``rsqrt``, the two roundings,
no FMA contraction); only the sum of squares needs care, because its order is fixed by the
register layout of the reduction, and the norm runs ``norm_warps(BLOCK)`` warps (8 for a row of
2048) where the router runs 4. On the GPU (``WARP_SUM``) this kernel therefore sums in the norm
kernel's order explicitly: the norm's layout for a 16-bit row (sm_90 TTGIR: ``sizePerThread [8],
threadsPerWarp [32], warpsPerCTA [NW]``, one repetition for BLOCK <= 4096) gives warp
``w`` the 256 values ``[256 w, 256 w + 256)``, 8 consecutive a thread summed in order, then the 32
lanes by butterfly (xor 16, 8, 4, 2, 1), then the NW warp sums by butterfly through shared memory
(xor NW/2 ... 1). Here the row is loaded as ``[NW, 256]`` (row ``w`` = the norm's warp ``w``), so
``tl.sum(axis=1)`` runs the first two steps in one warp with the same layout inside it, and the
warp sums are then added pairwise in the butterfly's order (``reshape [2, n/2]``, sum over the
pair: one add each, exact whatever the layout). ``layout_compile_check.py norm_router`` compiles
both kernels for sm_90 and checks these layouts and the shuffle order in the PTX; the GPU test
compares the bits. Under Triton's interpreter (``WARP_SUM`` off) both kernels take numpy's sum of
the flat row instead, so the interpreter checks every other bit.

Only integer atomics (``split_k.last_to_arrive``), a launch's shapes depend on ``T`` alone (CUDA
graphs capture it), PDL as every decode kernel (``USE_PDL``). Used where the router would take
its fused epilogue (:func:`moe_router_gemv.fused_router_plan`) and the norm its Triton kernel;
``LOOM_MOE_NORM_ROUTER=0`` (``kernel_switches.moe_norm_router``) keeps the two launches.
"""

# mypy: disable-error-code="no-untyped-def"
# (Triton kernels take untyped pointer arguments; annotations there would change their meaning.)
from __future__ import annotations

import torch

from loom import kernel_switches

from . import dense_gemv, fused_ops, moe_router_gemv
from .dense_gemv import GemvPlan, gemv_tile
from .moe_router_gemv import _merge_and_route, fused_router_supported
from .moe_routing_triton import HAS_TRITON, _block_e, _cdiv, _jit, _next_pow2, _routing_outputs, route_rows
from .split_k import counters
from .triton_jit import pdl_launch, pdl_prologue

if HAS_TRITON:  # (without it the kernel stays a plain function, never launched)
    import triton.language as tl

_TOKENS = 16  # the GEMV dot's columns: the token rows, padded (as the dense GEMV and the router)
_WARP_COLS = 256  # columns a warp of the norm kernel holds for a 16-bit row: 32 lanes x 8
# Rows whose norm layout is one repetition of 8 values x 32 lanes x NW warps (BLOCK <= 4096) with at
# least as many norm warps as the router's 4 (so that this kernel's warps split the [NW, 256] rows,
# never a row: sm_90 TTGIR of a [2, 256] tile put 2 warps along a row).
_MIN_BLOCK, _MAX_BLOCK = 1024, 4096


@_jit()
def _round(x, dtype: tl.constexpr):
    # x (float32) rounded to dtype and widened back (fused_ops._round).
    return x.to(dtype).to(tl.float32)


@_jit()
def _sum_squares(sq, NW: tl.constexpr, LOG_NW: tl.constexpr, WARP_COLS: tl.constexpr, WARP_SUM: tl.constexpr):
    # sq [NW, BLOCK / NW] float32 (row w: the norm kernel's warp w's columns) -> the row's sum in
    # _add_rms_norm_kernel's order (module docstring); without WARP_SUM numpy's, as there.
    if WARP_SUM:
        s = tl.sum(sq, axis=1)  # [NW]: each warp's 8 values a thread in order, then its 32 lanes
        for level in tl.static_range(LOG_NW):  # warp w + n/2 added to warp w, n halving
            s = tl.sum(tl.reshape(s, [2, NW >> (level + 1)]), axis=0)
        return tl.sum(s, axis=0)  # one value
    return tl.sum(tl.reshape(sq, [NW * WARP_COLS]), axis=0)


@_jit("M")
def _norm_router_route_kernel(x_ptr, res_ptr, norm_w_ptr, normed_ptr, res_out_ptr, w_ptr, logits_ptr, part_ptr,
                              counter_ptr, weights_ptr, ids_ptr,
                              M, N, K, K_SPLIT, SPLIT, TILES, stride_xt, stride_rt, stride_wn, stride_l, eps,
                              EVEN_K: tl.constexpr, IEEE: tl.constexpr, MAX_ROWS: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_S: tl.constexpr, TOP_K: tl.constexpr, ROUTE_T: tl.constexpr,
                              BLOCK_TK: tl.constexpr, BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr,
                              NW: tl.constexpr, LOG_NW: tl.constexpr, WARP_COLS: tl.constexpr,
                              WARP_SUM: tl.constexpr,
                              USE_PDL: tl.constexpr = False):
    # x, res [M, K] (row strides stride_xt, stride_rt); norm_w [K]; normed [TILES, M, K] contiguous:
    # tile n's copy of the normed rows (only the columns of its programs' splits written; copy 0 is
    # the layer's output); res_out [M, K] contiguous. Then _router_route_kernel's arguments.
    if USE_PDL:  # x and the residual come from the kernels before
        pdl_prologue()
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    dtype = normed_ptr.dtype.element_ty
    cols = tl.arange(0, NW)[:, None] * WARP_COLS + tl.arange(0, WARP_COLS)[None, :]  # [NW, WARP_COLS]
    mask = cols < K
    k_start = pid_s * K_SPLIT
    mine = mask & (cols >= k_start) & (cols < k_start + K_SPLIT)  # this program's split of K
    xs_ptr = normed_ptr + pid_n * (M * K)  # this tile's copy
    for r in tl.static_range(MAX_ROWS):
        if r < M:  # _add_rms_norm_kernel's row r, every expression as there
            h = tl.load(x_ptr + r * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
            res = tl.load(res_ptr + r * stride_rt + cols, mask=mask, other=0.0)
            h = _round(res.to(tl.float32) + h, dtype)
            variance = _sum_squares(h * h, NW, LOG_NW, WARP_COLS, WARP_SUM) / K
            normed = _round(h * tl.rsqrt(variance + eps), dtype)
            w = tl.load(norm_w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(xs_ptr + r * K + cols, (w * normed).to(dtype), mask=mine)
            if pid_n == 0:
                tl.store(res_out_ptr + r * K + cols, h.to(dtype), mask=mine)
    tl.debug_barrier()  # the split's normed columns, stored by every thread, read below by the tile's loads
    acc, offs_n, n_mask, offs_m, m_mask = gemv_tile(xs_ptr, w_ptr, M, N, K, K_SPLIT, K, stride_wn, pid_n, pid_s,
                                                    EVEN_K, IEEE, False, BLOCK_N, BLOCK_K, BLOCK_M,
                                                    w_ptr, 0, 0)  # (dense: no block scales)
    _merge_and_route(acc, offs_n, n_mask, offs_m, m_mask, logits_ptr, part_ptr, counter_ptr, weights_ptr, ids_ptr,
                     M, N, SPLIT, TILES, stride_l, pid_n, pid_s, MAX_ROWS, BLOCK_S, TOP_K, ROUTE_T, BLOCK_TK, BLOCK_E,
                     RENORMALIZE)


def norm_router_supported(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                          router_weight: torch.Tensor, top_k: int, plan: GemvPlan) -> bool:
    """Whether :func:`norm_route` serves these operands with ``plan`` (any device: the interpreter
    tests run it on the CPU): the router's fused epilogue serves them
    (:func:`moe_router_gemv.fused_router_supported`), the norm's operands are ``fused_add_rms_norm``'s
    (same shape and dtype), and the rows are contiguous, 16-byte aligned, a multiple of 16 long (as
    Triton specializes them: the norm kernel then loads 8 values a thread) with a block of 1024
    to 4096 columns, where the norm kernel's layout is the one this kernel's sum reproduces (16-bit
    rows on the GPU; any dtype under the interpreter, which sums in numpy's order)."""
    if x.dim() != 2:
        return False
    h = x.shape[1]
    block = _next_pow2(h)
    aligned = all(a.data_ptr() % 16 == 0 for a in (x, residual, norm_weight))
    return (fused_router_supported(x, router_weight, top_k, plan)
            and residual.shape == x.shape and residual.dtype == x.dtype
            and norm_weight.shape == (h,) and norm_weight.dtype == x.dtype
            and x.is_contiguous() and residual.is_contiguous() and norm_weight.is_contiguous()
            and aligned and h % 16 == 0 and _MIN_BLOCK <= block <= _MAX_BLOCK
            and fused_ops.norm_warps(block) == block // _WARP_COLS >= plan.num_warps
            and (x.element_size() == 2 or not x.is_cuda))


def norm_router_plan(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                     router_weight: torch.Tensor, top_k: int) -> GemvPlan | None:
    """The router's GEMV plan for :func:`norm_route`, or None (the norm and the router run
    apart): ``LOOM_MOE_NORM_ROUTER`` on, the norm on its Triton kernel
    (``fused_ops.norm_supported``), the router on its fused epilogue
    (:func:`moe_router_gemv.fused_router_plan`: CUDA, the table's plan), and
    :func:`norm_router_supported`."""
    if not kernel_switches.moe_norm_router or not fused_ops.norm_supported(x, norm_weight, residual):
        return None
    plan = moe_router_gemv.fused_router_plan(x, router_weight, top_k)
    if plan is None or not norm_router_supported(x, residual, norm_weight, router_weight, top_k, plan):
        return None
    return plan


def norm_route(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
               router_weight: torch.Tensor, top_k: int, renormalize: bool, weights_dtype: torch.dtype | None,
               plan: GemvPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``normed, h = fused_add_rms_norm(x, residual, norm_weight, eps)`` then
    ``route_from_hidden(normed, router_weight, top_k, renormalize, weights_dtype, plan)`` in one
    launch, the same bits: ``(normed [T, H], h [T, H], weights [T, k], expert ids [T, k] int32)``.
    Only where :func:`norm_router_supported`; raises if the split-K counters are unavailable
    (the first call on a device inside a CUDA-graph capture: warm up first, as the engine does)."""
    t, h = x.shape
    e = router_weight.shape[0]
    ctr = counters(x.device)
    if ctr is None:
        raise RuntimeError("the fused norm and router need the split-K counters (allocated outside graph capture)")
    k_blocks = _cdiv(h, plan.block_k)
    k_split = _cdiv(k_blocks, max(1, plan.split)) * plan.block_k
    split = _cdiv(h, k_split)
    tiles = _cdiv(e, plan.block_n)
    normed = torch.empty(tiles, t, h, dtype=x.dtype, device=x.device)  # a copy a tile; [0] is the output
    res_out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    logits = torch.empty(t, e, dtype=x.dtype, device=x.device)
    logits, weights, ids = _routing_outputs(logits, top_k, weights_dtype)
    part = torch.empty(split, t, e, dtype=torch.float32, device=x.device)
    block = _next_pow2(h)
    _norm_router_route_kernel[(tiles, split)](
        x, residual, norm_weight, normed, res_out, router_weight, logits, part, ctr, weights, ids,
        t, e, h, k_split, split, tiles, x.stride(0), residual.stride(0), router_weight.stride(0), logits.stride(0),
        eps,
        EVEN_K=h % plan.block_k == 0, IEEE=x.dtype == torch.float32, MAX_ROWS=dense_gemv.MAX_M,
        BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, BLOCK_M=_TOKENS, BLOCK_S=_next_pow2(split),
        TOP_K=top_k, ROUTE_T=route_rows(e), BLOCK_TK=_next_pow2(top_k), BLOCK_E=_block_e(e),
        RENORMALIZE=renormalize, NW=block // _WARP_COLS,
        LOG_NW=(block // _WARP_COLS).bit_length() - 1, WARP_COLS=_WARP_COLS, WARP_SUM=x.is_cuda,
        num_warps=plan.num_warps, num_stages=plan.num_stages, enable_fp_fusion=False, **pdl_launch(x.device))
    return normed[0], res_out, weights, ids
