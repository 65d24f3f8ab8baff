"""Triton kernels that route a Mixture-of-Experts layer's tokens and sort their rows by expert (CUDA).

A step's ``T`` tokens each pick ``k`` experts: ``N = T * k`` (token, expert) rows, numbered
``i = t * k + j``. Routing turns the router logits ``[T, E]`` into each token's ``k`` weights and
expert ids; sorting lays the rows out expert by expert for the grouped GEMMs of
``fused_moe_triton``: each expert's rows (in increasing ``i``) start at its offset, a multiple of
``BLOCK_M``, and are padded to a whole number of ``BLOCK_M``-row blocks with the sentinel ``N``.
That layout (:class:`ExpertLayout`) is ``sorted_ids [NB * BLOCK_M]`` (a row index or ``N``),
``block_expert [NB]`` (the expert of each block) and ``num_padded [1]`` (rows in use, padding
included); entries past ``num_padded`` are not written (every later kernel stops there).

Two ways to get there, with the same results bit for bit:

* any batch: ``_route_kernel`` (one program per ``ROUTE_ROWS`` tokens: softmax in float32, top-k
  on the logits, renormalisation), then ``_count_kernel`` and ``_place_kernel`` (one program per
  expert each): three launches;
* a few tokens (decode: at most one routing tile, :func:`fused_route_supported`):
  ``_route_sort_kernel``, one program that routes the tile and sorts its rows in registers: one
  launch. On the H200 a launch of these tiny kernels costs about 1.3 to 2.5 us of a decode step,
  whatever they compute; this saves two of them per MoE layer.

Both route through the same ``_route_tile`` on the same ``[ROUTE_ROWS, E]`` tile with the same
number of warps, so every token's softmax sum and renormalisation are reduced in one fixed order:
a token's weights are the same bits whichever path runs and whatever else is in the batch. The
sorts are integer work (exact). Shapes depend only on ``T`` (and the model), no host sync: the
layer is captured in a CUDA graph per batch size.

Triton is optional: without it this module imports (kernels stay plain functions) and
``HAS_TRITON`` is False.
"""

# mypy: disable-error-code="no-untyped-def"
# (Triton kernels take untyped pointer arguments; annotations there would change their meaning.)
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .triton_jit import pdl_launch, pdl_prologue

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

# LOOM_MOE_ONE_LAUNCH_ROUTING=1: SparseMoeBlock routes and sorts decode-sized batches in one
# launch (route_and_sort) instead of three. Off by default: on the H200 (2026-12-03,
# scripts/bench_decode_fusions.py, bench/results/gpu-decode-fusions.json) the one program took
# 7.23 us against 6.92 us for the three launches at one token (7.34 against 6.98 at eight): its
# serial count and placement over 128 experts cost more than the two launches it saves.
ONE_LAUNCH_ROUTING = os.environ.get("LOOM_MOE_ONE_LAUNCH_ROUTING", "0") == "1"

# Tokens one routing program handles (both paths: see the module docstring), and its warps.
ROUTE_ROWS = 8
ROUTE_WARPS = 4
# The routing tile holds at most this many logits (float32, a few copies live at once): past
# it, fewer rows a program, and from one row on the fused path is off.
_MAX_ROUTE_TILE = 4096
# The fused sort holds a [rows, CHUNK] one-hot of the tile's rows in registers: at most this
# many rows (ROUTE_ROWS tokens of at most 16 experts).
_MAX_FUSED_ROWS = 128
_SORT_CHUNK = 32  # experts a step of the fused sort's loop handles


def _jit(*unspecialized: str) -> Callable[[Callable[..., Any]], Any]:
    """``triton.jit``, not specializing on the named integer arguments (the token count changes
    with every batch: one compiled variant serves them all, so a new batch size never compiles
    mid-serving); without triton the kernels stay plain functions, never launched."""

    def wrap(fn: Callable[..., Any]) -> Any:
        return triton.jit(fn, do_not_specialize=list(unspecialized)) if HAS_TRITON else fn

    return wrap


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def num_blocks_bound(num_rows: int, num_experts: int, block_m: int) -> int:
    """Blocks of ``block_m`` rows enough for any routing of ``num_rows`` rows over the experts:
    each active expert (at most ``a = min(num_rows, num_experts)``) pads at most ``block_m - 1``
    rows, and takes at most one block more than its whole blocks (``a + num_rows // block_m``)."""
    active = min(num_rows, num_experts)
    return min(_cdiv(num_rows + active * (block_m - 1), block_m), active + num_rows // block_m)


@dataclass(frozen=True)
class ExpertLayout:
    """The rows of a step sorted by expert, as the grouped GEMMs read them (module docstring)."""

    sorted_ids: torch.Tensor  # [NB * block_m] int32: a row index i, or the sentinel N
    block_expert: torch.Tensor  # [NB] int32
    num_padded: torch.Tensor  # [1] int32
    block_m: int


def _block_e(num_experts: int) -> int:
    return max(16, _next_pow2(num_experts))


def route_rows(num_experts: int) -> int:
    """Tokens a routing program handles for ``num_experts`` experts (fixed per model, so a
    token's weights never depend on the batch)."""
    return max(1, min(ROUTE_ROWS, _MAX_ROUTE_TILE // _block_e(num_experts)))


# ------------------------------------------------------------------------------------------------
# Routing
# ------------------------------------------------------------------------------------------------


@_jit()
def _route_tile(logits_ptr, t0, T, E, stride_l,
                K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                RENORMALIZE: tl.constexpr, FROM_L2: tl.constexpr):
    # Tokens t0 .. t0 + BLOCK_T - 1 (those below T): the softmax of each one's E logits in
    # float32, its K largest (chosen on the logits, whose order the softmax keeps; equal ones
    # lowest expert first), renormalised. Returns (weights [BT, BK] float32, experts [BT, BK]
    # int32); slots past K hold junk, rows past T repeat row T - 1 (T >= 1; finite: no NaN).
    # FROM_L2: the logits were written by other programs of this launch (moe_router_gemv): read
    # them from L2, never from a stale L1 line.
    t = tl.minimum(t0 + tl.arange(0, BLOCK_T), T - 1)
    e = tl.arange(0, BLOCK_E)
    ok = (e < E)[None, :]
    if FROM_L2:
        raw = tl.load(logits_ptr + t.to(tl.int64)[:, None] * stride_l + e[None, :], mask=ok,
                      other=float("-inf"), cache_modifier=".cg")
    else:
        raw = tl.load(logits_ptr + t.to(tl.int64)[:, None] * stride_l + e[None, :], mask=ok, other=float("-inf"))
    logits = raw.to(tl.float32)  # [BT, BE]
    ex = tl.where(ok, tl.exp(logits - tl.max(logits, axis=1)[:, None]), 0.0)
    probs = ex / tl.sum(ex, axis=1)[:, None]  # as torch.softmax(dtype=float32)
    slots = tl.arange(0, BLOCK_K)[None, :]
    chosen_p = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    chosen_e = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    rest = logits
    for j in tl.static_range(K):
        best = tl.argmax(rest, axis=1, tie_break_left=True)[:, None]  # [BT, 1]
        hit = e[None, :] == best
        chosen_p = tl.where(slots == j, tl.sum(tl.where(hit, probs, 0.0), axis=1)[:, None], chosen_p)
        chosen_e = tl.where(slots == j, best.to(tl.int32), chosen_e)
        rest = tl.where(hit, float("-inf"), rest)
    if RENORMALIZE:
        chosen_p = chosen_p / tl.sum(tl.where(slots < K, chosen_p, 0.0), axis=1)[:, None]
    return chosen_p, chosen_e


@_jit()
def _store_routing(weights_ptr, ids_ptr, chosen_p, chosen_e, t0, T,
                   K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    # Row t * K + j of weights [T, K] and ids [T, K].
    t = t0 + tl.arange(0, BLOCK_T)[:, None]
    j = tl.arange(0, BLOCK_K)[None, :]
    ok = (t < T) & (j < K)
    row = t.to(tl.int64) * K + j
    tl.store(weights_ptr + row, chosen_p.to(weights_ptr.dtype.element_ty), mask=ok)
    tl.store(ids_ptr + row, chosen_e, mask=ok)


@_jit("T")
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, T, E, stride_l,
                  K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                  RENORMALIZE: tl.constexpr, USE_PDL: tl.constexpr = False):
    # Program p routes tokens p * BLOCK_T .. p * BLOCK_T + BLOCK_T - 1.
    if USE_PDL:  # the logits come from the router's GEMM
        pdl_prologue()
    t0 = tl.program_id(0) * BLOCK_T
    chosen_p, chosen_e = _route_tile(logits_ptr, t0, T, E, stride_l, K, BLOCK_T, BLOCK_K, BLOCK_E, RENORMALIZE, False)
    _store_routing(weights_ptr, ids_ptr, chosen_p, chosen_e, t0, T, K, BLOCK_T, BLOCK_K)


def route_supported(router_logits: torch.Tensor, top_k: int) -> bool:
    """Whether :func:`route` serves these logits (the kernel holds a token's experts in one tile)."""
    return router_logits.dim() == 2 and router_logits.shape[1] <= 4096 and 0 < top_k <= 64


def _routing_outputs(router_logits: torch.Tensor, top_k: int,
                     weights_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    T = router_logits.shape[0]
    dev = router_logits.device
    weights = torch.empty(T, top_k, dtype=weights_dtype or torch.float32, device=dev)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=dev)
    return router_logits, weights, ids


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          weights_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`loom.layers.fused_moe.select_experts` in one launch (where torch takes five:
    softmax, top-k, sum, divide, cast): ``(weights [T, k] in weights_dtype or float32, expert
    ids [T, k] int32)``. The experts are chosen on the logits, so the choice is exact; equal
    logits go to the lowest expert first (``torch.topk`` leaves that order unspecified). The
    weights are the float32 softmax's, computed with the device's exp."""
    router_logits, weights, ids = _routing_outputs(router_logits, top_k, weights_dtype)
    T, E = router_logits.shape
    rows = route_rows(E)
    if T:
        _route_kernel[(_cdiv(T, rows),)](router_logits, weights, ids, T, E, router_logits.stride(0), K=top_k,
                                         BLOCK_T=rows, BLOCK_K=_next_pow2(top_k), BLOCK_E=_block_e(E),
                                         RENORMALIZE=renormalize, num_warps=ROUTE_WARPS,
                                         **pdl_launch(router_logits.device))
    return weights, ids


# ------------------------------------------------------------------------------------------------
# Sorting rows by expert: any number of rows
# ------------------------------------------------------------------------------------------------


@_jit("N")
def _count_kernel(ids_ptr, counts_ptr, N, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    # Program e counts the rows routed to expert e (ids: [N] flat expert ids).
    if USE_PDL:  # the ids come from the routing
        pdl_prologue()
    e = tl.program_id(0)
    total = tl.zeros([BLOCK], tl.int32)
    for start in range(0, N, BLOCK):
        i = start + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + i, mask=i < N, other=-1)
        total += (ids == e).to(tl.int32)
    tl.store(counts_ptr + e, tl.sum(total, axis=0))


@_jit("N")
def _place_kernel(ids_ptr, counts_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, N, E,
                  BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, USE_PDL: tl.constexpr = False):
    # Program e writes its expert's rows and padding into sorted_ids and its blocks' expert id.
    if USE_PDL:  # the ids and counts come from the routing and _count_kernel
        pdl_prologue()
    e = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + experts, mask=experts < E, other=0)  # [BLOCK_E]
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # each expert's rows, padded
    offset = tl.sum(tl.where(experts < e, padded, 0), axis=0)  # where expert e's rows start
    mine = tl.sum(tl.where(experts == e, counts, 0), axis=0)
    mine_padded = tl.sum(tl.where(experts == e, padded, 0), axis=0)
    if e == 0:
        tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    running = offset
    for start in range(0, N, BLOCK):
        i = start + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + i, mask=i < N, other=-1)
        hit = (ids == e).to(tl.int32)
        pos = running + tl.cumsum(hit, axis=0) - 1  # each hit's place, in increasing i
        tl.store(sorted_ptr + pos, i, mask=hit > 0)
        running += tl.sum(hit, axis=0)
    pad = tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + offset + mine + pad, N, mask=pad < mine_padded - mine)
    first_block = offset // BLOCK_M
    for b in range(0, mine_padded // BLOCK_M, BLOCK):
        j = b + tl.arange(0, BLOCK)
        tl.store(block_expert_ptr + first_block + j, e, mask=j < mine_padded // BLOCK_M)


def _layout_buffers(num_rows: int, num_experts: int, block_m: int,
                    dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    nb = num_blocks_bound(num_rows, num_experts, block_m)
    return (torch.empty(nb * block_m, dtype=torch.int32, device=dev), torch.empty(nb, dtype=torch.int32, device=dev),
            torch.empty(1, dtype=torch.int32, device=dev))


def align_rows_by_expert(topk_ids: torch.Tensor, num_experts: int,
                         block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``topk_ids [T, k]`` -> ``(sorted_ids [NB * block_m] int32, block_expert [NB] int32,
    num_padded [1] int32)`` as described in the module docstring (entries past ``num_padded``
    are unwritten)."""
    ids = topk_ids.reshape(-1)
    if ids.dtype != torch.int32:
        ids = ids.to(torch.int32)
    n = ids.shape[0]
    sorted_ids, block_expert, num_padded = _layout_buffers(n, num_experts, block_m, ids.device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    block = 1024  # one compiled variant for every batch (a decode step's few rows leave it mostly masked)
    pdl = pdl_launch(ids.device)
    _count_kernel[(num_experts,)](ids, counts, n, BLOCK=block, **pdl)
    _place_kernel[(num_experts,)](ids, counts, sorted_ids, block_expert, num_padded, n, num_experts,
                                  BLOCK=block, BLOCK_E=_block_e(num_experts), BLOCK_M=block_m, **pdl)
    return sorted_ids, block_expert, num_padded


# ------------------------------------------------------------------------------------------------
# Routing and sorting in one launch: one routing tile
# ------------------------------------------------------------------------------------------------


@_jit("T")
def _route_sort_kernel(logits_ptr, weights_ptr, ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
                       T, E, stride_l,
                       K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                       RENORMALIZE: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                       MAX_BLOCKS: tl.constexpr, USE_PDL: tl.constexpr = False):
    # One program, T <= BLOCK_T: _route_kernel's tile, then _count_kernel's and _place_kernel's
    # layout computed from the chosen experts in registers. Every store below writes its own
    # addresses (rows, each expert's padding, each expert's blocks): no ordering between them.
    if USE_PDL:  # the logits come from the router's GEMM
        pdl_prologue()
    chosen_p, chosen_e = _route_tile(logits_ptr, 0, T, E, stride_l, K, BLOCK_T, BLOCK_K, BLOCK_E, RENORMALIZE, False)
    _store_routing(weights_ptr, ids_ptr, chosen_p, chosen_e, 0, T, K, BLOCK_T, BLOCK_K)
    BLOCK_N: tl.constexpr = BLOCK_T * BLOCK_K
    f = tl.arange(0, BLOCK_N)  # the tile's rows flattened in (t, j) order, i.e. in increasing i
    ok = (f // BLOCK_K < T) & (f % BLOCK_K < K)
    rows = (f // BLOCK_K) * K + f % BLOCK_K  # i = t * K + j
    experts = tl.reshape(chosen_e, [BLOCK_N])
    n = T * K  # the sentinel
    pos = tl.zeros([BLOCK_N], tl.int32)  # each row's place in sorted_ids
    total = tl.sum(tl.zeros([CHUNK], tl.int32), axis=0)  # padded rows of the experts before the chunk
    for c0 in range(0, E, CHUNK):
        ex = c0 + tl.arange(0, CHUNK)
        hit = ((experts[:, None] == ex[None, :]) & ok[:, None]).to(tl.int32)  # [BN, CHUNK] one-hot
        count = tl.sum(hit, axis=0)  # [CHUNK] rows of each expert
        padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        start = total + tl.cumsum(padded, axis=0) - padded  # where each expert's rows start
        rank = tl.cumsum(hit, axis=0) - 1  # a row's place among its expert's rows, in increasing i
        pos += tl.sum(hit * (start[None, :] + rank), axis=1)  # a row hits one expert of one chunk
        pad = tl.arange(0, BLOCK_M)[None, :]
        tl.store(sorted_ptr + (start + count)[:, None] + pad, tl.zeros([CHUNK, BLOCK_M], tl.int32) + n,
                 mask=pad < (padded - count)[:, None])
        b = tl.arange(0, MAX_BLOCKS)[None, :]
        tl.store(block_expert_ptr + (start // BLOCK_M)[:, None] + b, ex[:, None] + b * 0,
                 mask=b < (padded // BLOCK_M)[:, None])
        total += tl.sum(padded, axis=0)
    tl.store(sorted_ptr + pos, rows, mask=ok)
    tl.store(num_padded_ptr, total)


def fused_route_supported(router_logits: torch.Tensor, top_k: int) -> bool:
    """Whether :func:`route_and_sort` serves these logits: one routing tile's tokens (at most
    ``ROUTE_ROWS``, fewer past 512 experts), and at most ``_MAX_FUSED_ROWS`` rows in it.

    Past one tile a single program would route in turn the tiles that ``_route_kernel``'s
    programs route side by side, and the count and placement that one program per expert does
    in parallel; at decode sizes (the CUDA-graph batches 1 to 8) the launches cost more."""
    if not route_supported(router_logits, top_k):
        return False
    rows = route_rows(router_logits.shape[1])
    return 1 <= router_logits.shape[0] <= rows and rows * _next_pow2(top_k) <= _MAX_FUSED_ROWS


def route_and_sort(router_logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int,
                   weights_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, ExpertLayout]:
    """:func:`route` then :func:`align_rows_by_expert` in one launch, with the same results:
    ``(weights [T, k], expert ids [T, k] int32, the rows' layout for block_m-row blocks)``.
    Only where :func:`fused_route_supported`."""
    router_logits, weights, ids = _routing_outputs(router_logits, top_k, weights_dtype)
    T, E = router_logits.shape
    sorted_ids, block_expert, num_padded = _layout_buffers(T * top_k, E, block_m, router_logits.device)
    rows, block_k = route_rows(E), _next_pow2(top_k)
    _route_sort_kernel[(1,)](
        router_logits, weights, ids, sorted_ids, block_expert, num_padded, T, E, router_logits.stride(0),
        K=top_k, BLOCK_T=rows, BLOCK_K=block_k, BLOCK_E=_block_e(E), RENORMALIZE=renormalize, BLOCK_M=block_m,
        CHUNK=min(_SORT_CHUNK, _block_e(E)), MAX_BLOCKS=_next_pow2(_cdiv(rows * block_k, block_m)),
        num_warps=ROUTE_WARPS, **pdl_launch(router_logits.device))
    return weights, ids, ExpertLayout(sorted_ids, block_expert, num_padded, block_m)
