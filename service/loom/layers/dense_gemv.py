"""A Triton GEMV for dense bf16 / fp16 linear layers at 1-4 tokens, where cuBLAS falls short.

At batch 1 on the H200 cuBLAS runs some skinny shapes well below the copy bandwidth: Qwen3-30B-A3B's
qkv_proj (2048 -> 5120) at 2.7 TB/s, its o_proj (4096 -> 2048) as split-K plus a reduce kernel at
1.9 TB/s, its router (2048 -> 128) in 5 us for half a megabyte (bench/results/
profile-random-qwen3-30b-a3b-b1.txt), while llama-8b's large layers reach ~95% of the copy rate.
So the kernel here serves only the ``(N, K)`` shapes that a measured table names
(:mod:`loom.layers.dense_gemv_table`, filled from ``scripts/bench_dense_gemv.py`` on the GPU the
numbers are for; empty until measured, so nothing changes before then).

The kernel: one program owns ``BLOCK_N`` rows of ``W [N, K]`` (outputs) over one piece of K and
multiplies them by the ``M <= 4`` token rows as ``W_tile [BLOCK_N, BLOCK_K] @ x_tile^T [BLOCK_K,
16]`` on the tensor cores (the tokens padded to 16 columns: the dot's smallest), float32
accumulation, so the weight streams through shared memory in the software pipeline Triton builds
for dots. With too few output tiles to fill the GPU the K range is split
(:func:`loom.layers.split_k.split_k`), each split writing float32 partial sums
(``store_gemv``, shared with the W4A16 GEMV), merged in a fixed order either by a second launch
(``split_sum_kernel``) or by the last split of each output tile to finish (``last_to_arrive``, an
integer counter: no float atomics). Every launch depends only on shapes: CUDA-graph capturable.

Numerics and batch invariance: each output is ``sum_k x[m, k] W[n, k]`` in float32 in an order
fixed by the plan (the K tiles, the dot's k16 steps, the splits), rounded once. A plan is chosen
by ``(N, K)`` alone, not by M, and the dot computes every output from its own row and column: a
token's outputs are the same bits whether it runs alone or with up to three other rows. That
does not make bf16 batch-invariant in Loom: at five rows and more cuBLAS serves the layer (as it
serves every shape today, choosing its own kernels by M), and attention's split count depends on
the batch size. So, as before, a request's bf16 output can differ with the batch it is in; within
1-4 rows on a tabled shape it no longer does.

FP8 weights (``loom_plugins.quant.fp8_gemv``) run the same kernel on their e4m3 codes with a
float32 scale per output channel (``dense_gemv(..., scale=)``): the codes are converted in
registers, bf16 activations dotted in fp16 after a power-of-two scaling per row (the kernel's
comments say why and how exactly), each channel's scale applied once to a program's sums.

Switches (:mod:`loom.kernel_switches`): ``LOOM_DENSE_GEMV=0`` keeps every layer on cuBLAS,
``LOOM_DENSE_GEMV=all`` uses the GEMV with :func:`default_plan` on every shape at M <= 4 (for
measurements), ``LOOM_FUSED_KERNELS=0`` turns it off with the other kernels. The CPU keeps
``F.linear``.
"""

# mypy: disable-error-code="no-untyped-def"
# (Triton kernels take untyped pointer arguments; annotations there would change their meaning.)
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from loom import kernel_switches
from loom.layers import dense_gemv_table
from loom.layers.split_k import (
    counters,
    last_to_arrive,
    split_k,
    split_sum_kernel,
    split_tree_sum,
    store_gemv,
)
from loom.layers.triton_jit import jit as _jit
from loom.layers.triton_jit import pdl_launch, pdl_prologue

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

MAX_M = 4  # the most token rows the GEMV serves
_TOKENS = 16  # the dot's columns: the token rows, padded
_REDUCE_BLOCK = 256  # outputs a program of split_sum_kernel


@dataclass(frozen=True)
class GemvPlan:
    block_n: int  # weight rows (outputs) a program
    block_k: int  # inputs an iteration
    split: int  # programs along K (recounted at launch so that no piece is empty)
    num_warps: int
    num_stages: int
    fused_reduce: bool = False  # the last split of an output tile adds the partials: no second launch


def default_plan(n: int, k: int, sms: int) -> GemvPlan:
    """The rule before measurement (``LOOM_DENSE_GEMV=all``, and the sweep's first candidate):
    64 x 128 tiles, four warps, three stages, K split until about four programs an SM."""
    bn, bk = 64, 128
    split, _ = split_k(-(-n // bn), k, bk, 4 * sms, 16)
    return GemvPlan(bn, bk, split, 4, 3)


def tile_within_block(limit: int, block_inputs: int) -> int:
    """The largest power of two at most ``limit`` (and at least 16, the dot's smallest) that divides
    ``block_inputs``: a K tile that lies within one block of block-wise scales, so each tile's sums
    take one scale a row. ValueError when the blocks are not a multiple of 16 inputs."""
    if block_inputs % 16:
        raise ValueError(f"scale blocks of {block_inputs} inputs are not a multiple of 16")
    tile = limit
    while block_inputs % tile:
        tile //= 2
    return tile


def table_plan(n: int, k: int, m: int, sms: int) -> GemvPlan | None:
    """The measured plan of an ``n x k`` layer at ``m`` rows on a GPU of ``sms`` SMs, or None
    (cuBLAS) when the table has none or the entry serves fewer rows."""
    entry = dense_gemv_table.PLANS.get((sms, n, k))
    if entry is None or m > entry[0]:
        return None
    _, bn, bk, split, warps, stages, fused = entry
    return GemvPlan(bn, bk, split, warps, stages, fused)


@_jit
def f16_row_scales(x_rows, m_mask, k_start, k_end, K, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr):
    """``(up, down)`` [BLOCK_M] float32 powers of two for dotting bf16 rows in fp16: each row's max
    |x| over inputs ``[k_start, k_end)`` (``x_rows [BLOCK_M, 1]`` pointers to the rows, padding
    rows masked by ``m_mask``) -> ``up = 2^p``, p = 141 - its exponent, which puts that maximum in
    [2^14, 2^15), and ``down = 2^-p`` (exactly ``1 / up``). Shared by :func:`gemv_tile` and the
    FP8 experts of ``fused_moe_triton``."""
    offs_k = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + offs_k
        xa = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k < K)[None, :], other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(xa.to(tl.float32)), axis=1))
    e = tl.minimum(tl.maximum((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF, 15), 254)
    up = ((268 - e) << 23).to(tl.float32, bitcast=True)  # [BLOCK_M] 2^(141 - e)
    down = ((e - 14) << 23).to(tl.float32, bitcast=True)  # [BLOCK_M] 2^(e - 141), exactly 1 / up
    return up, down


@_jit
def gemv_tile(x_ptr, w_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn, pid_n, pid_s,
              EVEN_K: tl.constexpr, IEEE: tl.constexpr, X_F16: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
              scale_ptr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr):
    """Program (pid_n, pid_s)'s sums ``acc [BLOCK_N, BLOCK_M]`` (acc[n, m] = out[m, n] over inputs
    [pid_s * K_SPLIT, + K_SPLIT)), with ``offs_n``, ``n_mask`` ([BLOCK_N]) and ``offs_m``, ``m_mask``
    ([BLOCK_M]): the prologue and K loop of :func:`_dense_gemv_kernel` and of
    ``moe_router_gemv._router_route_kernel`` (the same loads and dots: the same bits), inlined
    into each by Triton. X_F16: see :func:`_dense_gemv_kernel`. SCALE_BK (> 0, with SCALE_BN):
    block-wise FP8, ``scale_ptr`` the float32 ``[cdiv(N, SCALE_BN), cdiv(K, SCALE_BK)]`` grid;
    each K tile (within one block: BLOCK_K divides SCALE_BK, K_SPLIT is whole blocks) is dotted
    on its own and added times its blocks' scales (0: the sums accumulate in the dot)."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features
    n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M] token rows (M of them real)
    m_mask = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    x_rows = x_ptr + offs_m[:, None] * stride_xm  # [BLOCK_M, 1]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_start = pid_s * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    if X_F16:
        up, down = f16_row_scales(x_rows, m_mask, k_start, k_end, K, BLOCK_K, BLOCK_M)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + offs_k
        if EVEN_K:  # every K tile whole: masks on rows only
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None], other=0.0)  # [BLOCK_N, BLOCK_K]
            x = tl.load(x_rows + k[None, :], mask=m_mask[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
        else:
            k_ok = k < K
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_ok[None, :], other=0.0)
        if SCALE_BK:  # this tile's blocks' scales [BLOCK_N]
            s = tl.load(scale_ptr + (offs_n // SCALE_BN) * tl.cdiv(K, SCALE_BK) + k0 // SCALE_BK, mask=n_mask,
                        other=0.0)
            if X_F16:
                xh = (x.to(tl.float32) * up[:, None]).to(tl.float16)
                acc += tl.dot(w.to(tl.float16), tl.trans(xh)) * s[:, None]
            elif IEEE:
                acc += tl.dot(w.to(x.dtype), tl.trans(x), input_precision="ieee") * s[:, None]
            else:
                acc += tl.dot(w.to(x.dtype), tl.trans(x)) * s[:, None]
        elif X_F16:
            xh = (x.to(tl.float32) * up[:, None]).to(tl.float16)  # [BLOCK_M, BLOCK_K]
            acc = tl.dot(w.to(tl.float16), tl.trans(xh), acc)
        elif IEEE:  # float32 operands (tests): no TF32 rounding
            acc = tl.dot(w.to(x.dtype), tl.trans(x), acc, input_precision="ieee")
        else:  # w.to: e4m3 codes -> x's dtype (a no-op for dense weights)
            acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)  # [BLOCK_N, BLOCK_M]: acc[n, m] = out[m, n]
    if X_F16:
        acc = acc * down[None, :]  # exact: a power of two
    return acc, offs_n, n_mask, offs_m, m_mask


@_jit
def _dense_gemv_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, part_ptr, counter_ptr,
                       M, N, K, K_SPLIT, SPLIT, stride_xm, stride_wn, stride_om,
                       HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, FUSED_REDUCE: tl.constexpr,
                       EVEN_K: tl.constexpr, IEEE: tl.constexpr, W_SCALE: tl.constexpr, X_F16: tl.constexpr,
                       MAX_ROWS: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_S: tl.constexpr, SCALE_BN: tl.constexpr = 0, SCALE_BK: tl.constexpr = 0,
                       USE_PDL: tl.constexpr = False):
    # One program: outputs offs_n of the M token rows, over inputs [pid_s * K_SPLIT, + K_SPLIT).
    # W_SCALE (FP8 weights, plugins/quant/fp8_gemv.py): w holds e4m3 codes, converted in registers
    # (exactly: every e4m3 value is a bf16 and an fp16 value), and each output channel's float32
    # scale multiplies the program's sums once, before they are stored (partial or not).
    # X_F16 (bf16 activations with e4m3 weights): the dot runs in fp16, where e4m3 -> fp16 is one
    # instruction a pair of codes (-> bf16 costs three more, and the conversions, not the bytes,
    # would set the time). Each row of x is scaled by the power of two that puts its largest |x|
    # over this program's K range in [2^14, 2^15) before the fp16 rounding: bf16's 8 bits fit
    # fp16's 11 exactly for every value within 2^-28 of that maximum (smaller ones are off by at
    # most 2^-39 of it), and the sums take the power of two back exactly.
    if USE_PDL:  # x comes from the kernel before (the weights never do, but the wait stays first)
        pdl_prologue()
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    acc, offs_n, n_mask, offs_m, m_mask = gemv_tile(x_ptr, w_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn, pid_n,
                                                    pid_s, EVEN_K, IEEE, X_F16, BLOCK_N, BLOCK_K, BLOCK_M,
                                                    scale_ptr, SCALE_BN, SCALE_BK)
    if W_SCALE and not SCALE_BK:  # acc[n, m] * scale[n]: one float32 rounding, in the same place whatever the split
        acc = acc * tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
    mask = n_mask[:, None] & m_mask[None, :]
    if PARTIAL:
        # partial sums [SPLIT, M, N]: split pid_s's at pid_s * M * N + m * N + n
        store_gemv(acc, part_ptr, offs_m[None, :] * N + offs_n[:, None], mask, bias_ptr, offs_n[:, None],
                   n_mask[:, None], pid_s, M * N, HAS_BIAS, True)
        if FUSED_REDUCE:  # noqa: SIM102 (a constexpr branch: the counter exists only then)
            if last_to_arrive(counter_ptr + pid_n, SPLIT):
                for r in tl.static_range(MAX_ROWS):
                    if r < M:  # row r's partials of every split, summed in one fixed tree order
                        store_gemv(split_tree_sum(part_ptr, r, offs_n, n_mask, M, N, SPLIT, BLOCK_S), out_ptr,
                                   r * stride_om + offs_n, n_mask, bias_ptr, offs_n, n_mask, 0, 0, HAS_BIAS, False)
    else:
        store_gemv(acc, out_ptr, offs_m[None, :] * stride_om + offs_n[:, None], mask, bias_ptr, offs_n[:, None],
                   n_mask[:, None], 0, 0, HAS_BIAS, False)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: GemvPlan,
               scale: torch.Tensor | None = None, scale_block: tuple[int, int] | None = None) -> torch.Tensor:
    """``x [..., K] @ weight[N, K]^T (+ bias)`` in ``x``'s dtype for at most ``MAX_M`` rows of x.
    With ``scale`` (float32 ``[N]``, contiguous) the weight may be float8_e4m3fn codes and row n
    of W is ``weight[n] * scale[n]``: the FP8 weight-only GEMV (``loom_plugins.quant.fp8_gemv``).
    With ``scale_block = (bn, bk)`` the scale is one per block (``[cdiv(N, bn), cdiv(K, bk)]``):
    block-wise FP8 (``plan.block_k`` must divide bk; the K split is cut at whole blocks)."""
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if not 0 < m <= MAX_M:
        raise ValueError(f"the dense GEMV serves 1..{MAX_M} rows, got {m}")
    if weight.stride(1) != 1:
        raise ValueError("the dense GEMV reads weight rows contiguous along K")
    if scale_block is not None:
        bn, bk = scale_block
        grid = (-(-n // bn), -(-k // bk))
        if scale is None or scale.dtype != torch.float32 or tuple(scale.shape) != grid or not scale.is_contiguous():
            raise ValueError(f"the GEMV's block scales must be a contiguous float32 grid {list(grid)}")
        if bk % plan.block_k:
            raise ValueError(f"the GEMV's K tile {plan.block_k} does not divide the scale blocks' {bk} inputs")
    elif scale is not None and (scale.dtype != torch.float32 or scale.numel() != n or scale.stride(-1) != 1):
        raise ValueError(f"the GEMV's weight scale must be {n} contiguous float32 values")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    unit = plan.block_k if scale_block is None else scale_block[1]  # a split holds whole units
    k_blocks = -(-k // unit)
    k_split = -(-k_blocks // max(1, plan.split)) * unit
    split = -(-k // k_split)  # no empty piece
    tiles = triton.cdiv(n, plan.block_n)
    partial = split > 1
    ctr = counters(x.device) if partial and plan.fused_reduce else None
    fused = ctr is not None and tiles <= ctr.numel()
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if partial else out
    b = bias if bias is not None else out  # not read without a bias
    _dense_gemv_kernel[(tiles, split)](
        x2, weight, scale if scale is not None else out, b, out, part, ctr if fused else out,
        m, n, k, k_split, split, x2.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, PARTIAL=partial, FUSED_REDUCE=fused, EVEN_K=k % plan.block_k == 0,
        IEEE=x.dtype == torch.float32, W_SCALE=scale is not None,
        X_F16=scale is not None and x.dtype == torch.bfloat16 and weight.dtype != torch.bfloat16,
        MAX_ROWS=MAX_M, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
        BLOCK_M=_TOKENS, BLOCK_S=_next_pow2(split), num_warps=plan.num_warps, num_stages=plan.num_stages,
        **({} if scale_block is None else {"SCALE_BN": scale_block[0], "SCALE_BK": scale_block[1]}),
        **pdl_launch(x.device))
    if partial and not fused:
        split_sum_kernel[(m, triton.cdiv(n, _REDUCE_BLOCK))](part, b, out, n, split, part.stride(0), part.stride(1),
                                                            out.stride(0), HAS_BIAS=bias is not None,
                                                            BLOCK_N=_REDUCE_BLOCK, num_warps=4,
                                                            **pdl_launch(x.device))
    return out.view(*lead, n)


@functools.cache
def _sm_count(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def plan_for(x: torch.Tensor, weight: torch.Tensor) -> GemvPlan | None:
    """The plan that serves ``x @ weight^T`` on the GEMV, or None (cuBLAS): CUDA, Triton, bf16
    or fp16 operands of one dtype, at most ``MAX_M`` rows, a shape the table names (every shape
    with ``LOOM_DENSE_GEMV=all``), the switches on."""
    mode = kernel_switches.dense_gemv
    if mode == "off" or not kernel_switches.fused_kernels or not HAS_TRITON or not x.is_cuda:
        return None
    if mode == "table" and not dense_gemv_table.PLANS:
        return None
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype or weight.dim() != 2:
        return None
    n, k = weight.shape
    if x.shape[-1] != k or not 0 < x.numel() <= MAX_M * k or weight.stride(1) != 1:
        return None
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    sms = _sm_count(index)
    if mode == "all":
        return default_plan(n, k, sms)
    return table_plan(n, k, x.numel() // k, sms)


def maybe_dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``x @ weight^T (+ bias)`` on the GEMV when :func:`plan_for` picks it, else None."""
    plan = plan_for(x, weight)
    return None if plan is None else dense_gemv(x, weight, bias, plan)
