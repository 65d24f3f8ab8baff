"""Triton kernels of the fused Mixture-of-Experts layer's experts (CUDA), and their launcher.

A step's tokens each pick ``k`` experts: ``N = T * k`` (token, expert) rows, numbered
``i = t * k + j``, routed and sorted by expert by ``moe_routing_triton`` (its module docstring
describes the layout: ``sorted_ids``, ``block_expert``, ``num_padded``; one launch at decode
sizes, three past them). The experts then run as grouped GEMMs over those rows, three launches
per layer whatever the number of experts:

1. ``_gate_up_kernel``: one launch for all experts; a program multiplies one block of rows by
   one column tile of its expert's gate and up matrices (``w13 [E, 2I, H]``) and writes
   ``silu(gate) * up`` (``act [N, I]``, row ``i`` at ``i``): the activation is its epilogue.
2. ``_down_kernel``: the same grouping over ``w2 [E, H, I]``: ``y [N, H]``.
3. ``_combine_kernel``: ``out[t] = sum_j w[t, j] * y[t * k + j]`` in float32, in ``j`` order.
   Where the layer's output goes straight into a residual add and RMSNorm (Llama-family decoders
   on one rank), the layer hands back the rows unsummed (:class:`ExpertOutputs`) and the norm
   kernel does this sum, rounded the same way, before its add: one launch fewer.

A one-token step (:func:`direct_experts`) skips the sort: its ``k`` experts are distinct, so
block ``b`` is row ``b`` alone and its expert is ``ids[b]``, read straight from the routing's ids
(the kernels' ``DIRECT``): the same blocks and rows the sorted layout gives, so the same bits,
with two launches fewer a layer. Its tiles may come from a measured table per kernel
(``moe_plan_table``: tilings that leave every row's reduction order as it is).

FP8 experts (``loom_plugins.quant.fp8_moe``) run the same two kernels on e4m3 codes with a float32
scale per output channel (``W_SCALE``): weight-only, the codes converted in registers, each
channel's sums scaled once before the epilogue; bf16 activations are dotted in fp16 after a
power-of-two scaling per row (``X_F16``, ``dense_gemv.f16_row_scales``), as the FP8 GEMV of linear
layers does.

Shapes depend only on ``T`` (and the model): ``NB`` blocks (``num_blocks_bound``) hold any
routing, the grids are fixed, and the device-side ``num_padded`` tells programs
past the real blocks to return. No host sync, no data-dependent allocation: the layer can be
captured in a CUDA graph per batch size.

The order of rows inside an expert's group is increasing ``i`` (deterministic), and a row's
result does not depend on the other rows of its block, so a token's output is the same whatever
else is in the batch (up to the block size choice, which depends on ``N``).

Triton is optional: without it this module imports (kernels stay plain functions) and
``HAS_TRITON`` is False.
"""

# mypy: disable-error-code="no-untyped-def"
# (Triton kernels take untyped pointer arguments; annotations there would change their meaning.)
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from loom import kernel_switches

from . import moe_plan_table
from .dense_gemv import f16_row_scales, tile_within_block
from .moe_routing_triton import HAS_TRITON as HAS_TRITON  # the layer asks this module
from .moe_routing_triton import ExpertLayout, _cdiv, _jit, _next_pow2, align_rows_by_expert
from .triton_jit import pdl_launch, pdl_prologue

if HAS_TRITON:  # (without it the kernels stay plain functions, never launched)
    import triton.language as tl


# Steps of at most this many tokens run their experts without the sort (direct_experts): one.
DIRECT_MAX_TOKENS = 1


@dataclass(frozen=True)
class MoeBlockConfig:
    """Tile sizes of the two grouped GEMMs (rows, output columns, reduction) and launch options."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def block_config(num_rows: int, num_experts: int, dtype: torch.dtype) -> MoeBlockConfig:
    """Tiles for ``num_rows = T * k`` rows over ``num_experts`` experts.

    Few rows per expert (decode): 16-row blocks (the smallest ``tl.dot`` takes), so the weights
    dominate and each is read once; many rows per expert (prefill): larger blocks reuse each
    weight tile over more rows. float32 tiles are halved along the reduction to fit shared memory.
    Not tuned on a GPU yet: these are conventional starting points.
    """
    per_expert = num_rows / max(1, num_experts)
    if per_expert <= 4:
        cfg = MoeBlockConfig(16, 64, 128, 4, 4)
    elif per_expert <= 32:
        cfg = MoeBlockConfig(32, 64, 64, 4, 4)
    else:
        cfg = MoeBlockConfig(64, 128, 64, 8, 3)
    if dtype == torch.float32:
        cfg = MoeBlockConfig(cfg.block_m, min(cfg.block_n, 64), 32, cfg.num_warps, 2)
    return cfg


# ------------------------------------------------------------------------------------------------
# Grouped GEMMs
# ------------------------------------------------------------------------------------------------


@_jit()
def _block_live(num_padded_ptr, pid_m, BLOCK_M: tl.constexpr, DIRECT: tl.constexpr):
    # Whether block pid_m holds rows (DIRECT: every block does; sorted: those below num_padded).
    if DIRECT:  # noqa: SIM108 - a constexpr branch: only one side is compiled
        live = pid_m >= 0
    else:
        live = pid_m * BLOCK_M < tl.load(num_padded_ptr)
    return live


@_jit()
def _block_rows(sorted_ptr, pid_m, N, BLOCK_M: tl.constexpr, DIRECT: tl.constexpr):
    # The rows of block pid_m (int64 [BLOCK_M]; the sentinel N marks padding). Sorted layout:
    # read from sorted_ids. DIRECT: block b is row b alone (its expert is ids[b], read by the
    # caller through block_expert_ptr), the other BLOCK_M - 1 places are padding.
    if DIRECT:
        r = tl.arange(0, BLOCK_M)
        rows = tl.where(r == 0, pid_m, N).to(tl.int64)
    else:
        rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return rows


@_jit("N")
def _gate_up_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [E, 2I, H]: gate rows 0..I-1, up rows I..2I-1
    out_ptr,  # [N, I]: silu(gate) * up, row i at i
    sorted_ptr, block_expert_ptr, num_padded_ptr,
    scale_ptr,  # [E, 2I] float32 (W_SCALE): row n of expert e's w13 is w[e, n] * scale[e, n]
    N, K, INTER,  # INTER: I
    stride_xt, stride_we, stride_wn, stride_wk, stride_ot, stride_se,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, DIRECT: tl.constexpr, EVEN_K: tl.constexpr,
    W_SCALE: tl.constexpr = False, X_F16: tl.constexpr = False,
    SCALE_BN: tl.constexpr = 0, SCALE_BK: tl.constexpr = 0, USE_PDL: tl.constexpr = False,
):
    # W_SCALE: w holds e4m3 codes (FP8 experts, weight-only), converted in registers and each
    # output channel's scale applied once to the sums. With SCALE_BN / SCALE_BK (> 0) the scales
    # are per block of SCALE_BN rows x SCALE_BK inputs instead ([E, cdiv(2I, BN), cdiv(K, BK)],
    # block-wise FP8): each K tile (within one block: BLOCK_K divides SCALE_BK) is dotted on its
    # own and added to the sums times its blocks' scales. X_F16 (bf16 activations with e4m3
    # codes): the dots run in fp16, each row of x scaled by a power of two first (dense_gemv's
    # f16_row_scales: e4m3 -> fp16 is one instruction a pair of codes, -> bf16 four).
    if USE_PDL:  # x, the layout and the experts chosen (which weights to read) come from before
        pdl_prologue()
    pid = tl.program_id(0)
    num_n = tl.cdiv(INTER, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    if _block_live(num_padded_ptr, pid_m, BLOCK_M, DIRECT):
        rows = _block_rows(sorted_ptr, pid_m, N, BLOCK_M, DIRECT)  # [BM]
        row_ok = rows < N
        tok = rows // TOP_K
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < INTER
        k = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + tok[:, None] * stride_xt  # [BM, 1]
        a_ptrs = x_rows + k[None, :]  # [BM, BK]
        g_ptrs = w_ptr + expert * stride_we + n[None, :] * stride_wn + k[:, None] * stride_wk  # [BK, BN]
        u_ptrs = g_ptrs + INTER * stride_wn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if X_F16:
            up, down = f16_row_scales(x_rows, row_ok, 0, K, K, BLOCK_K, BLOCK_M)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:  # every K tile whole: no mask on K, so Triton pipelines the loads (cp.async)
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                g = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
                u = tl.load(u_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = k + k0 < K
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if X_F16:
                a = (a.to(tl.float32) * up[:, None]).to(tl.float16)
            if SCALE_BK:  # this K tile's sums times its blocks' scales (gate rows n, up rows I + n)
                blocks = scale_ptr + expert * stride_se + k0 // SCALE_BK
                cols = tl.cdiv(K, SCALE_BK)
                s_g = tl.load(blocks + (n // SCALE_BN) * cols, mask=n_ok, other=0.0)
                s_u = tl.load(blocks + ((INTER + n) // SCALE_BN) * cols, mask=n_ok, other=0.0)
                acc_g += tl.dot(a, g.to(a.dtype), input_precision=PRECISION) * s_g[None, :]
                acc_u += tl.dot(a, u.to(a.dtype), input_precision=PRECISION) * s_u[None, :]
            else:
                acc_g = tl.dot(a, g.to(a.dtype), acc_g, input_precision=PRECISION)  # (.to: codes; dense: a no-op)
                acc_u = tl.dot(a, u.to(a.dtype), acc_u, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K * stride_wk
            u_ptrs += BLOCK_K * stride_wk
        if X_F16:  # exact: a power of two
            acc_g = acc_g * down[:, None]
            acc_u = acc_u * down[:, None]
        if W_SCALE and not SCALE_BK:  # one float32 rounding per channel
            scales = scale_ptr + expert * stride_se + n
            acc_g = acc_g * tl.load(scales, mask=n_ok, other=0.0)[None, :]
            acc_u = acc_u * tl.load(scales + INTER, mask=n_ok, other=0.0)[None, :]
        # As the torch path rounds: gate and up in the activation dtype, silu(gate) rounded,
        # then the product.
        dtype = out_ptr.dtype.element_ty
        gate = acc_g.to(dtype).to(tl.float32)
        up = acc_u.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(out_ptr + rows[:, None] * stride_ot + n[None, :], (act * up).to(dtype),
                 mask=row_ok[:, None] & n_ok[None, :])


@_jit("N")
def _down_kernel(
    a_ptr,  # [N, I]
    w_ptr,  # [E, H, I]
    out_ptr,  # [N, H], row i at i
    sorted_ptr, block_expert_ptr, num_padded_ptr,
    scale_ptr,  # [E, H] float32 (W_SCALE)
    N, K, H,
    stride_at, stride_we, stride_wn, stride_wk, stride_ot, stride_se,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    DIRECT: tl.constexpr, EVEN_K: tl.constexpr, W_SCALE: tl.constexpr = False, X_F16: tl.constexpr = False,
    SCALE_BN: tl.constexpr = 0, SCALE_BK: tl.constexpr = 0, USE_PDL: tl.constexpr = False,
):
    # W_SCALE, X_F16, SCALE_BN / SCALE_BK: as in _gate_up_kernel (scales [E, H] or [E, cdiv(H, BN),
    # cdiv(I, BK)]).
    if USE_PDL:  # the activations, the layout and the experts chosen come from before
        pdl_prologue()
    pid = tl.program_id(0)
    num_n = tl.cdiv(H, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    if _block_live(num_padded_ptr, pid_m, BLOCK_M, DIRECT):
        rows = _block_rows(sorted_ptr, pid_m, N, BLOCK_M, DIRECT)  # [BM]
        row_ok = rows < N
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < H
        k = tl.arange(0, BLOCK_K)
        a_rows = a_ptr + rows[:, None] * stride_at  # [BM, 1]
        a_ptrs = a_rows + k[None, :]
        b_ptrs = w_ptr + expert * stride_we + n[None, :] * stride_wn + k[:, None] * stride_wk
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if X_F16:
            up, down = f16_row_scales(a_rows, row_ok, 0, K, K, BLOCK_K, BLOCK_M)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:  # as in _gate_up_kernel
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = k + k0 < K
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if X_F16:
                a = (a.to(tl.float32) * up[:, None]).to(tl.float16)
            if SCALE_BK:
                s_b = tl.load(scale_ptr + expert * stride_se + (n // SCALE_BN) * tl.cdiv(K, SCALE_BK) + k0 // SCALE_BK,
                              mask=n_ok, other=0.0)
                acc += tl.dot(a, b.to(a.dtype), input_precision=PRECISION) * s_b[None, :]
            else:
                acc = tl.dot(a, b.to(a.dtype), acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * stride_wk
        if X_F16:
            acc = acc * down[:, None]
        if W_SCALE and not SCALE_BK:
            acc = acc * tl.load(scale_ptr + expert * stride_se + n, mask=n_ok, other=0.0)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_ot + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & n_ok[None, :])


@_jit()
def _combine_kernel(y_ptr, w_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
                    USE_PDL: tl.constexpr = False):
    # out[t, cols] = sum_j w[t, j] * y[t * k + j, cols]; in float32, j in order. (The residual
    # add + norm kernel of fused_ops sums the same way when it folds this in.)
    if USE_PDL:  # the rows and weights come from the experts and the routing
        pdl_prologue()
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK], tl.float32)
    for j in range(TOP_K):
        w = tl.load(w_ptr + t * TOP_K + j).to(tl.float32)
        y = tl.load(y_ptr + (t * TOP_K + j) * H + cols, mask=mask, other=0.0).to(tl.float32)
        acc += (y * w).to(dtype).to(tl.float32)  # each weighted expert output in the dtype, as HF adds them
    tl.store(out_ptr + t * H + cols, acc.to(dtype), mask=mask)


def combine_rows(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``rows [T * k, H]`` (contiguous), ``weights [T, k]`` -> ``[T, H]``: each token's expert
    rows weighted and summed. Compiled without FMA contraction: in float32 each product is
    rounded before the add, as torch's separate ops (and the fused norm) do."""
    T, k = weights.shape
    H = rows.shape[1]
    out = torch.empty((T, H), dtype=rows.dtype, device=rows.device)
    if T:
        block = min(1024, _next_pow2(H))
        _combine_kernel[(T, _cdiv(H, block))](rows, weights.contiguous(), out, H, TOP_K=k, BLOCK=block,
                                              enable_fp_fusion=False, **pdl_launch(rows.device))
    return out


@dataclass(frozen=True)
class ExpertOutputs:
    """An MoE layer's output before its weighted sum: row ``t * k + j`` of ``rows [T * k, H]``
    (contiguous) is token ``t``'s ``j``-th expert's output, ``weights [T, k]`` the routing
    weights. :meth:`combine` sums them; a norm that follows the layer can sum them itself
    (``RMSNorm.forward_with_residual``)."""

    rows: torch.Tensor
    weights: torch.Tensor

    def combine(self) -> torch.Tensor:  # [T, H]
        return combine_rows(self.rows, self.weights)


def direct_experts(num_tokens: int) -> bool:
    """Whether a step of ``num_tokens`` tokens runs its experts straight from the routing's ids
    (block ``b`` is row ``b`` alone, its expert ``ids[b]``), with no sort by expert: two launches
    fewer a layer (``_count_kernel``, ``_place_kernel``). At one token the ``k`` experts are
    distinct, so this is exactly the sorted layout's work (each chosen expert's weights read once,
    a block of one row each); past one token a shared expert would be read once a row, which
    costs more than the two launches save. ``LOOM_MOE_DIRECT_EXPERTS=0`` keeps the sort."""
    return kernel_switches.moe_direct_experts and 1 <= num_tokens <= DIRECT_MAX_TOKENS


@functools.cache
def _sm_count(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def direct_configs(x: torch.Tensor, hidden: int, inter: int,
                   weight_dtype: torch.dtype | None = None) -> tuple[MoeBlockConfig, MoeBlockConfig]:
    """The gate/up and down kernels' tiles for a one-token (direct) step on ``x``'s device: the
    measured table's (``moe_plan_table``, measured on dense experts) where it names the shape,
    else ``block_config``'s (always for e4m3 experts, whose tiles are not measured yet)."""
    cfg = block_config(1, 1, x.dtype)
    if not x.is_cuda or not moe_plan_table.PLANS or weight_dtype not in (None, x.dtype):
        return cfg, cfg
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    entry = moe_plan_table.PLANS.get((_sm_count(index), hidden, inter, str(x.dtype).removeprefix("torch.")))
    if entry is None:
        return cfg, cfg
    return MoeBlockConfig(cfg.block_m, *entry[0]), MoeBlockConfig(cfg.block_m, *entry[1])


def _even_k(k: int, cfg: MoeBlockConfig, even_k: bool | None) -> bool:
    """Whether the K loop runs without a K mask: every K tile whole (None), unless ``even_k`` says
    (False: the masked loop, for measurements; True only where K is a multiple of the tile)."""
    whole = k % cfg.block_k == 0
    return whole if even_k is None else even_k and whole


def _weight_options(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, rows: int,
                    block: tuple[int, int] | None) -> tuple[torch.Tensor, int, dict[str, Any]]:
    """The scale operand, its expert stride and the kernels' ``W_SCALE`` / ``X_F16`` /
    ``SCALE_BN`` / ``SCALE_BK`` for weights ``w [E, rows, K]`` (dense: no scale; e4m3 codes: float32
    ``scale [E, rows]``, one per output channel, or with ``block = (bn, bk)`` one per block of
    ``[E, cdiv(rows, bn), cdiv(K, bk)]``; contiguous)."""
    if scale is None:
        if w.dtype != x.dtype:
            raise ValueError(f"dense experts in {w.dtype} with activations in {x.dtype}")
        return w, 0, {}  # (the scale pointer is never read)
    e, k = w.shape[0], w.shape[2]
    shape = (e, rows) if block is None else (e, _cdiv(rows, block[0]), _cdiv(k, block[1]))
    if w.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32 or tuple(scale.shape) != shape \
            or not scale.is_contiguous():
        raise ValueError(f"scaled experts take float8_e4m3fn codes and contiguous float32 scales {list(shape)}, "
                         f"got {w.dtype} and {scale.dtype} {list(scale.shape)}")
    options: dict[str, Any] = {"W_SCALE": True, "X_F16": x.dtype == torch.bfloat16}
    if block is not None:
        options.update(SCALE_BN=block[0], SCALE_BK=block[1])
    return scale, scale.stride(0), options


def _tiles_within_blocks(cfg: MoeBlockConfig, block: tuple[int, int] | None) -> MoeBlockConfig:
    """``cfg`` with K tiles that each lie within one scale block (the largest power of two at most
    ``cfg.block_k`` that divides the block's inputs, at least 16: the dot's smallest)."""
    if block is None or block[1] % cfg.block_k == 0:
        return cfg
    return MoeBlockConfig(cfg.block_m, cfg.block_n, tile_within_block(cfg.block_k, block[1]), cfg.num_warps,
                          cfg.num_stages)


def launch_gate_up(x: torch.Tensor, w13: torch.Tensor, act: torch.Tensor, sorted_ids: torch.Tensor,
                   block_expert: torch.Tensor, num_padded: torch.Tensor, top_k: int, cfg: MoeBlockConfig,
                   direct: bool, even_k: bool | None = None, scale: torch.Tensor | None = None,
                   block: tuple[int, int] | None = None) -> None:
    """``act [N, I] = silu(x w_gate^T) * (x w_up^T)`` for every row of the layout (``direct``:
    ``block_expert`` is the flat ids [N] and the two others are not read). Where every K tile is
    whole the loop has no K mask, which lets Triton pipeline its loads (with a mask that depends
    on the loop index, triton 3.6 compiled plain register loads, no cp.async, for every stage
    count); the same values, so the same bits. ``scale`` (float32 ``[E, 2I]``): ``w13`` holds
    e4m3 codes and row n of expert e is ``w13[e, n] * scale[e, n]`` (FP8 experts, weight-only);
    with ``block = (bn, bk)``, ``scale [E, cdiv(2I, bn), cdiv(H, bk)]`` holds one per block."""
    n, inter = act.shape
    nb = n if direct else block_expert.shape[0]
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # ignored for half-precision inputs
    scale_arg, stride_se, options = _weight_options(x, w13, scale, 2 * inter, block)
    cfg = _tiles_within_blocks(cfg, block)
    _gate_up_kernel[(nb * _cdiv(inter, cfg.block_n),)](
        x, w13, act, sorted_ids, block_expert, num_padded, scale_arg,
        n, x.shape[1], inter,
        x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), act.stride(0), stride_se,
        TOP_K=top_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PRECISION=precision,
        DIRECT=direct, EVEN_K=_even_k(x.shape[1], cfg, even_k), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **options, **pdl_launch(x.device),
    )


def launch_down(act: torch.Tensor, w2: torch.Tensor, y: torch.Tensor, sorted_ids: torch.Tensor,
                block_expert: torch.Tensor, num_padded: torch.Tensor, cfg: MoeBlockConfig, direct: bool,
                even_k: bool | None = None, scale: torch.Tensor | None = None,
                block: tuple[int, int] | None = None) -> None:
    """``y [N, H] = act w_down^T`` for every row of the layout (as :func:`launch_gate_up`;
    ``scale``: float32 ``[E, H]``, or ``[E, cdiv(H, bn), cdiv(I, bk)]`` with ``block``)."""
    n, hidden = y.shape
    nb = n if direct else block_expert.shape[0]
    precision = "ieee" if act.dtype == torch.float32 else "tf32"
    scale_arg, stride_se, options = _weight_options(act, w2, scale, hidden, block)
    cfg = _tiles_within_blocks(cfg, block)
    _down_kernel[(nb * _cdiv(hidden, cfg.block_n),)](
        act, w2, y, sorted_ids, block_expert, num_padded, scale_arg,
        n, act.shape[1], hidden,
        act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), y.stride(0), stride_se,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PRECISION=precision,
        DIRECT=direct, EVEN_K=_even_k(act.shape[1], cfg, even_k), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **options, **pdl_launch(act.device),
    )


def expert_outputs_triton(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
    config: MoeBlockConfig | None = None,
    layout: ExpertLayout | None = None,
    direct: bool | None = None,
    w13_scale: torch.Tensor | None = None,  # [E, 2I] float32: w13 holds e4m3 codes
    w2_scale: torch.Tensor | None = None,  # [E, H] float32: w2 holds e4m3 codes
    scale_block: tuple[int, int] | None = None,  # the scales are per block of (rows, inputs)
) -> ExpertOutputs:
    """Every token's ``k`` experts, not yet summed: two launches, after the sort's two unless
    ``layout`` (``moe_routing_triton.route_and_sort``'s, for the same ids) is given with the
    block size this step's tiles use, or the step runs ``direct`` (None: :func:`direct_experts`;
    only without a layout). ``config``: both kernels' tiles (None: ``block_config``'s, or at one
    token ``direct_configs``'). ``w13_scale`` / ``w2_scale``: FP8 experts (e4m3 codes, a float32
    scale per output channel, or per block of ``scale_block`` rows x inputs; weight-only: the
    activations stay in their dtype)."""
    T, H = x.shape
    k = topk_ids.shape[1]
    E, two_i, _ = w13.shape
    inter = two_i // 2
    n = T * k
    y = torch.empty((n, H), dtype=x.dtype, device=x.device)  # row i at i, as the combine reads it
    if T == 0:
        return ExpertOutputs(y, topk_weights)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if direct is None:
        direct = layout is None and direct_experts(T)
    if direct:
        cfg_gu, cfg_down = (config, config) if config is not None else direct_configs(x, H, inter, w13.dtype)
        # Block b = row b: block_expert is the flat ids, sorted_ids and num_padded are not read.
        block_expert = topk_ids.reshape(-1)
        if block_expert.dtype != torch.int32:
            block_expert = block_expert.to(torch.int32)
        sorted_ids = num_padded = block_expert
    else:
        cfg_gu = cfg_down = config or block_config(n, E, x.dtype)
        if layout is None or layout.block_m != cfg_gu.block_m:
            layout = ExpertLayout(*align_rows_by_expert(topk_ids, E, cfg_gu.block_m), block_m=cfg_gu.block_m)
        sorted_ids, block_expert, num_padded = layout.sorted_ids, layout.block_expert, layout.num_padded
    act = torch.empty((n, inter), dtype=x.dtype, device=x.device)
    launch_gate_up(x, w13, act, sorted_ids, block_expert, num_padded, k, cfg_gu, direct, scale=w13_scale,
                   block=scale_block)
    launch_down(act, w2, y, sorted_ids, block_expert, num_padded, cfg_down, direct, scale=w2_scale,
                block=scale_block)
    return ExpertOutputs(y, topk_weights.contiguous())


def fused_experts_triton(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
    config: MoeBlockConfig | None = None,
    layout: ExpertLayout | None = None,
    direct: bool | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    scale_block: tuple[int, int] | None = None,
) -> torch.Tensor:  # [T, H]
    """Every token's ``k`` experts, weighted and summed: :func:`expert_outputs_triton`, then the
    combine (three launches after the sort, or with none at one token: :func:`direct_experts`)."""
    return expert_outputs_triton(x, w13, w2, topk_weights, topk_ids, config, layout, direct,
                                 w13_scale, w2_scale, scale_block).combine()
