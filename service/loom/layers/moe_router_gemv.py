"""The MoE router's GEMV with the routing in its epilogue: one launch where two run (CUDA, 1-4 tokens).

At a decode step the router (``x [T, H] @ W [E, H]^T``, half a megabyte for Qwen3-30B-A3B) runs on
the dense GEMV (``loom.layers.dense_gemv``, a measured plan with split K whose last split of
each output tile adds the partials), then ``moe_routing_triton._route_kernel`` turns the logits
into each token's ``k`` weights and experts: two launches of a few microseconds each, most of it
launch and latency (bench/results/profile-random-qwen3-30b-a3b-b1.txt: 4.2 + 2.5 us a layer).

Here the GEMV's programs are the dense GEMV's (same plan, same tiles, same order of every float
operation), and its epilogue goes one step further: the last split of each output tile to arrive
adds the partials and writes its logits (as the dense GEMV does), then counts itself in on one
more integer counter; the last tile to arrive routes every token from the finished logits with
``_route_tile``, the very code ``_route_kernel`` runs, at the same tile shape and number of warps
(so the same reduction layouts: the same bits; ``tests/gpu/test_fused_moe_gpu.py`` compares
them). Only integer atomics (``split_k.last_to_arrive``), so nothing depends on arrival order but
which program does the work: deterministic, and a launch's shapes depend on ``T`` alone, so CUDA
graphs capture it. The routing stays parallel with everything else: it is one program's work on
at most ``ROUTE_ROWS`` tokens, the same work ``_route_kernel``'s single program does at decode
sizes, minus its launch.

Used where every piece is there (:func:`fused_router_plan`): the dense GEMV's table names the
router's shape with split K, its warps are the routing's, one routing tile holds the tokens;
``LOOM_MOE_ROUTER_EPILOGUE=0`` (``kernel_switches.moe_router_epilogue``) keeps the two launches.
"""

# mypy: disable-error-code="no-untyped-def"
# (Triton kernels take untyped pointer arguments; annotations there would change their meaning.)
from __future__ import annotations

import torch

from loom import kernel_switches

from . import dense_gemv
from .dense_gemv import GemvPlan, gemv_tile
from .moe_routing_triton import (
    HAS_TRITON,
    ROUTE_WARPS,
    _block_e,
    _cdiv,
    _jit,
    _next_pow2,
    _route_tile,
    _routing_outputs,
    _store_routing,
    route_rows,
)
from .split_k import COUNTERS, counters, last_to_arrive, split_tree_sum
from .triton_jit import pdl_launch, pdl_prologue

if HAS_TRITON:  # (without it the kernel stays a plain function, never launched)
    import triton.language as tl

_TOKENS = 16  # the dot's columns: the token rows, padded (as the dense GEMV)
_MAX_EXPERTS, _MAX_TOP_K = 4096, 64  # what moe_routing_triton.route serves


@_jit("M")
def _router_route_kernel(x_ptr, w_ptr, logits_ptr, part_ptr, counter_ptr, weights_ptr, ids_ptr,
                         M, N, K, K_SPLIT, SPLIT, TILES, stride_xm, stride_wn, stride_l,
                         EVEN_K: tl.constexpr, IEEE: tl.constexpr, MAX_ROWS: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_S: tl.constexpr, TOP_K: tl.constexpr, ROUTE_T: tl.constexpr,
                         BLOCK_TK: tl.constexpr, BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr,
                         USE_PDL: tl.constexpr = False):
    # Program (pid_n, pid_s): dense_gemv's _dense_gemv_kernel with PARTIAL and FUSED_REDUCE and
    # no bias (its gemv_tile: the same loads and dots; the same partial stores and tree sum), then
    # the routing epilogue. acc [BLOCK_N, BLOCK_M]: acc[n, m] = logits[m, n].
    if USE_PDL:  # x comes from the norm before
        pdl_prologue()
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    acc, offs_n, n_mask, offs_m, m_mask = gemv_tile(x_ptr, w_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn, pid_n,
                                                    pid_s, EVEN_K, IEEE, False, BLOCK_N, BLOCK_K, BLOCK_M,
                                                    w_ptr, 0, 0)  # (dense: no block scales)
    _merge_and_route(acc, offs_n, n_mask, offs_m, m_mask, logits_ptr, part_ptr, counter_ptr, weights_ptr, ids_ptr,
                     M, N, SPLIT, TILES, stride_l, pid_n, pid_s, MAX_ROWS, BLOCK_S, TOP_K, ROUTE_T, BLOCK_TK, BLOCK_E,
                     RENORMALIZE)


@_jit()
def _merge_and_route(acc, offs_n, n_mask, offs_m, m_mask, logits_ptr, part_ptr, counter_ptr, weights_ptr, ids_ptr,
                     M, N, SPLIT, TILES, stride_l, pid_n, pid_s, MAX_ROWS: tl.constexpr, BLOCK_S: tl.constexpr,
                     TOP_K: tl.constexpr, ROUTE_T: tl.constexpr, BLOCK_TK: tl.constexpr, BLOCK_E: tl.constexpr,
                     RENORMALIZE: tl.constexpr):
    # Program (pid_n, pid_s)'s epilogue after gemv_tile (acc [BLOCK_N, BLOCK_M]: acc[n, m] =
    # logits[m, n] over its split of K): its partial sums stored, the last split of the tile merges
    # them into the logits, the last tile routes. Shared with moe_norm_router's kernel (inlined
    # by Triton into each: the same code, so the same bits).
    mask = n_mask[:, None] & m_mask[None, :]
    # partial sums [SPLIT, M, N]: split pid_s's at pid_s * M * N + m * N + n
    tl.store(part_ptr + pid_s * (M * N) + offs_m[None, :] * N + offs_n[:, None], acc, mask=mask)
    if last_to_arrive(counter_ptr + pid_n, SPLIT):
        for r in tl.static_range(MAX_ROWS):
            if r < M:  # row r's partials of every split, summed in one fixed tree order (the dense GEMV's)
                tl.store(logits_ptr + r * N + offs_n,
                         split_tree_sum(part_ptr, r, offs_n, n_mask, M, N, SPLIT, BLOCK_S).to(logits_ptr.dtype.element_ty),
                         mask=n_mask)
        # The last tile to finish its logits routes every token (logits [M, N]; stride_l = N, an
        # argument of its own so that it is specialized as _route_kernel's stride_l is: the same
        # divisibility, so the same vectorized load and register layout of the routing tile).
        if last_to_arrive(counter_ptr + TILES, TILES):
            chosen_p, chosen_e = _route_tile(logits_ptr, 0, M, N, stride_l, TOP_K, ROUTE_T, BLOCK_TK,
                                             BLOCK_E, RENORMALIZE, True)
            _store_routing(weights_ptr, ids_ptr, chosen_p, chosen_e, 0, M, TOP_K, ROUTE_T, BLOCK_TK)


def fused_router_plan(x: torch.Tensor, router_weight: torch.Tensor, top_k: int) -> GemvPlan | None:
    """The dense GEMV plan the fused router runs ``x [T, H] @ router_weight [E, H]^T`` with, or
    None (the router and the routing run apart): the switches on, CUDA, the dense GEMV's plan for
    the shape (its table's) splitting K with the routing's warps, one routing tile of tokens."""
    if not (kernel_switches.moe_router_epilogue and kernel_switches.fused_kernels and HAS_TRITON and x.is_cuda):
        return None
    plan = dense_gemv.plan_for(x, router_weight)
    if plan is None or x.dim() != 2 or counters(x.device) is None:
        return None
    return plan if fused_router_supported(x, router_weight, top_k, plan) else None


def fused_router_supported(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, plan: GemvPlan) -> bool:
    """Whether :func:`route_from_hidden` serves these operands with ``plan`` (any device: the
    interpreter tests run it on the CPU): split K merged by the last split (the dense GEMV's
    ``fused_reduce``, whose tree sum this kernel repeats), the routing's warps, one routing tile."""
    e, h = router_weight.shape
    t = x.shape[0]
    k_blocks = _cdiv(h, plan.block_k)
    split = _cdiv(h, _cdiv(k_blocks, max(1, plan.split)) * plan.block_k)
    return (x.dim() == 2 and x.shape[1] == h and 1 <= t <= min(dense_gemv.MAX_M, route_rows(e))
            and router_weight.stride(1) == 1 and x.dtype == router_weight.dtype
            and e <= _MAX_EXPERTS and 0 < top_k <= _MAX_TOP_K and plan.num_warps == ROUTE_WARPS and split > 1
            and plan.fused_reduce
            and _cdiv(e, plan.block_n) + 1 <= COUNTERS)


def route_from_hidden(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalize: bool,
                      weights_dtype: torch.dtype | None, plan: GemvPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_experts(x @ router_weight^T, top_k, renormalize, weights_dtype)`` in one launch:
    ``(weights [T, k] in weights_dtype or float32, expert ids [T, k] int32)``, the same bits as
    ``dense_gemv`` with ``plan`` then ``moe_routing_triton.route``. Only where
    :func:`fused_router_supported`; raises if the split-K counters are unavailable (the first
    call on a device inside a CUDA-graph capture: warm up first, as the engine does)."""
    e, h = router_weight.shape
    t = x.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    ctr = counters(x.device)
    if ctr is None:
        raise RuntimeError("the fused router needs the split-K counters (allocated outside graph capture)")
    logits = torch.empty(t, e, dtype=x.dtype, device=x.device)
    logits, weights, ids = _routing_outputs(logits, top_k, weights_dtype)
    k_blocks = _cdiv(h, plan.block_k)
    k_split = _cdiv(k_blocks, max(1, plan.split)) * plan.block_k
    split = _cdiv(h, k_split)
    tiles = _cdiv(e, plan.block_n)
    part = torch.empty(split, t, e, dtype=torch.float32, device=x.device)
    _router_route_kernel[(tiles, split)](
        x, router_weight, logits, part, ctr, weights, ids,
        t, e, h, k_split, split, tiles, x.stride(0), router_weight.stride(0), logits.stride(0),
        EVEN_K=h % plan.block_k == 0, IEEE=x.dtype == torch.float32, MAX_ROWS=dense_gemv.MAX_M,
        BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, BLOCK_M=_TOKENS, BLOCK_S=_next_pow2(split),
        TOP_K=top_k, ROUTE_T=route_rows(e), BLOCK_TK=_next_pow2(top_k), BLOCK_E=_block_e(e),
        RENORMALIZE=renormalize, num_warps=plan.num_warps, num_stages=plan.num_stages, **pdl_launch(x.device))
    return weights, ids
