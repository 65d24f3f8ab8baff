"""Split-K pieces shared by Loom's Triton kernels that cut a reduction over several programs.

A skinny GEMV (one to a few tokens) has too few output tiles to fill the GPU, so its K range is
cut into ``split`` pieces, each program writing float32 partial sums; the same holds for the
paged attention's decode, whose key range is cut into splits merged by their log-sum-exp. What
they share lives here, written once:

* :func:`split_k`: how many K pieces (and how long) for a grid of ``tiles`` output tiles to hold
  about ``target`` programs.
* ``store_gemv``: a GEMV program's epilogue: its float32 partial sums (split-K), or the finished
  outputs with the bias added, in the output's dtype.
* ``split_sum_kernel``: a second launch that adds the partial sums of every split in split order,
  adds the bias and casts.
* ``last_to_arrive``: instead of that second launch, the program of a group that finishes last
  does the merge itself. Each program stores its partial result, then counts itself in on an
  int32 counter (an integer atomic: the count is exact whatever the order); the one that sees
  ``expected - 1`` reads every partial in a fixed order and resets the counter to 0 for the next
  launch. The float sums are the same whichever program is last, so results stay deterministic
  run to run; only the counter's arrival order varies.

The counters of ``last_to_arrive`` must be zero before a launch and are left zero after it; one
buffer serves every launch of a stream in turn (launches on one stream do not overlap), so it is
allocated once, outside CUDA-graph capture (:func:`counters`).

Triton is optional: without it this module imports, the kernels stay plain functions and
:func:`counters` returns None.
"""

# mypy: disable-error-code="no-untyped-def"
# (Triton kernels take untyped pointer arguments; annotations there would change their meaning.)
from __future__ import annotations

import os

import torch

from loom.layers.triton_jit import jit as _jit
from loom.layers.triton_jit import pdl_prologue

try:
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False


def split_k(tiles: int, k: int, block_k: int, target: int, max_split: int) -> tuple[int, int]:
    """``(split, k_split)``: the fewest power-of-two pieces of K (at most ``max_split``, at least
    one K block each) for ``tiles * split`` to reach ``target`` programs; ``k_split`` inputs a
    piece (a multiple of ``block_k``), ``split`` then recounted so that no piece is empty."""
    k_blocks = -(-k // block_k)
    split = 1
    while tiles * split < target and split * 2 <= min(max_split, k_blocks):
        split *= 2
    k_split = -(-k_blocks // split) * block_k
    return -(-k // k_split), k_split


@_jit
def store_gemv(y, out_ptr, out_offs, out_mask, bias_ptr, bias_offs, bias_mask, pid_s, stride_os,
               HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr):
    """A GEMV program's outputs ``y`` (float32, any shape; ``out_offs`` / ``out_mask`` of the
    same shape): split ``pid_s``'s partial sums at ``out_ptr + pid_s * stride_os + out_offs``, or
    the finished outputs at ``out_ptr + out_offs`` with the bias (``bias_offs`` / ``bias_mask``,
    broadcast against ``y``) added, in the output's dtype."""
    if PARTIAL:
        tl.store(out_ptr + pid_s * stride_os + out_offs, y, mask=out_mask)
    else:
        if HAS_BIAS:
            y += tl.load(bias_ptr + bias_offs, mask=bias_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + out_offs, y.to(out_ptr.dtype.element_ty), mask=out_mask)


@_jit
def split_tree_sum(part_ptr, r, offs_n, n_mask, M, N, SPLIT, BLOCK_S: tl.constexpr):
    """Row ``r``'s float32 partial sums of every split (``part_ptr``: ``[SPLIT, M, N]``) at the
    columns ``offs_n``, summed in one fixed tree order: ``[BLOCK_N]`` float32. Read from L2
    (``.cg``), for the program that :func:`last_to_arrive` found last. The dense GEMV's merge and
    the MoE router's (which must give the same bits) both sum here."""
    s = tl.arange(0, BLOCK_S)
    p = tl.load(part_ptr + s[:, None] * (M * N) + r * N + offs_n[None, :],
                mask=(s < SPLIT)[:, None] & n_mask[None, :], other=0.0, cache_modifier=".cg")  # [BLOCK_S, BLOCK_N]
    return tl.sum(p, axis=0)


@_jit
def split_sum_kernel(part_ptr, bias_ptr, out_ptr, N, SPLIT, stride_ps, stride_pm, stride_om,
                     HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr = False):
    # The float32 partial sums of every split of row m, in split order, plus the bias, cast.
    if USE_PDL:  # the partial sums come from the GEMV before
        pdl_prologue()
    m = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in range(0, SPLIT):
        acc += tl.load(part_ptr + s * stride_ps + m * stride_pm + offs_n, mask=n_mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


@_jit
def last_to_arrive(counter_ptr, expected):
    """Whether this program is the last of the ``expected`` programs that share the int32 counter
    at ``counter_ptr`` to call this (each calls it once, after storing its partial result); the
    last one resets the counter to 0.

    The barrier orders every thread's stores before the count; the count is acquire-release at
    GPU scope, so the last program sees the others' stores once it has counted (read them with
    ``cache_modifier=".cg"``: from L2, never from a stale L1 line)."""
    tl.debug_barrier()
    seen = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = seen == expected - 1
    if last:
        tl.store(counter_ptr, 0)
    return last


COUNTERS = 16384  # int32 counters in a device's buffer: the most program groups one launch may count
_counters: dict[tuple[str, int], torch.Tensor] = {}


def counters(device: torch.device) -> torch.Tensor | None:
    """The zeroed int32 counters of ``last_to_arrive`` on ``device`` ([COUNTERS]), allocated on
    the first call. None without Triton, on a CPU device outside Triton's interpreter, and when
    the first call comes during CUDA-graph capture (an allocation there would belong to the
    graph's pool, re-zeroed by a memset node at every replay): the caller then merges its splits
    with a second launch instead."""
    if not HAS_TRITON:
        return None
    if device.type == "cuda":
        key = ("cuda", device.index if device.index is not None else torch.cuda.current_device())
    elif os.environ.get("TRITON_INTERPRET") == "1":
        key = (device.type, -1)
    else:
        return None
    buf = _counters.get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
        _counters[key] = buf
    return buf
