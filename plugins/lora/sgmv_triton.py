"""The LoRA delta on CUDA in two segmented, tiled Triton kernels (SGMV-style) over fixed-size slot
tables: one launch of each serves every adapter of the step, and rows of the base model (slot 0)
cost nothing but reading their slot.

    shrink: h[p, :]  = x[row(p), :] @ a[slot]^T             x [T, in], a [S, W, in] -> h [T, W] fp32
    expand: out[row(p), n] += h[p, cols(n)] @ b[slot][n, cols(n)]^T    b [S, out, W] -> out [T, out]

``W`` is the layer's parts P times ``--max-lora-rank`` R (``loom.lora.layers``): ``a`` stacks the
parts' A factors, ``b`` is block-diagonal (the outputs of part i use only the rank columns
``cols(n) = [i*R, (i+1)*R)``). ``p`` runs over the step's rows in ``order``, a permutation of them
(``row(p) = order[p]``, the identity when none is given): the layers pass the rows sorted by slot,
sorted once per step on the device (``LoraBatch.kernel_order``), so that rows of one adapter sit
next to each other even where decode rows of several adapters interleave. ``h`` is kept in that
order.

Tiles. A program of the shrink takes a tile of ``BLOCK_M`` consecutive rows (in ``order``), a
block of ``BLOCK_W`` rank columns and a range of K; a program of the expand a tile of rows and a
block of ``BLOCK_N`` outputs. Either serves all of its tile's rows in a data-dependent loop over
the distinct slots present: take the smallest slot above the last one done (never slot 0: base
rows have no delta), ``tl.dot`` the tile against that slot's factors with the other rows masked
off, store that slot's rows, until no slot is left. The rows of a prefill share a slot, so a tile
of them reads its adapter's factors once for ``BLOCK_M`` rows, where a GEMV per row (BGMV-style,
this module's first version) re-read them for every row: ~1 MB of gate/up B per row, 16 GB of L2
traffic per layer for a 16k-token prefill, against 128 MB now. A sorted decode tile holds one or
two slots; a tile of base rows only returns at once.

The expand reads, for a block of outputs inside part i, only that part's R rank columns
(``parts``: the parts' output sizes), not all P*R of the block-diagonal table: a third for qkv,
half for gate/up. A block straddling parts reads the columns of the parts it holds, each output
masked to its own part's, so the zeros (or anything) outside the diagonal blocks are never read.

Sizes. ``BLOCK_M`` is 16 until there are 128 tiles, up to 64 (prefills); ``BLOCK_K`` 64,
``BLOCK_W`` 16..64, ``BLOCK_N`` up to 128, the rank chunk ``BLOCK_R`` 16..64, 4 warps: every
``tl.dot`` dimension is 16 at least, masked loads pad a rank of 8 or a width of 48. With few tiles
(decode: 256 rows are 16 tiles) the shrink also splits K, up to about 256 programs and down to 4
K blocks each; each split writes its partial sums to its own ``h[split]``, which the expand adds
up as it loads h (deterministic: no atomics). The dots run on the tables' dtype (h rounded to it,
as the torch path's ``x @ a^T`` is) with float32 accumulation, the delta added to ``out`` in
float32 and rounded once; float32 tables use IEEE float32 dots, not TF32.

Nothing depends on host data: the slots and the order are read on the device and the grid depends
only on T and the table shapes, so a step can be captured in a CUDA graph and replayed with other
adapters in other slots.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

# Triton kernels take untyped pointers and sizes (their types are Triton's, at compile time).
# mypy: disable-error-code="no-untyped-def"

_NONE = 2**31 - 1  # the end of a part that does not exist
_NO_SLOT: tl.constexpr = tl.constexpr(_NONE)  # "no slot left" in the kernels' slot loops
_MAX_PARTS = 4  # part ends passed as scalars; a layer of more parts reads all W columns (still right)
_SHRINK_PROGRAMS = 256  # the shrink splits K until about this many programs (H200: 132 SMs)
_MAX_SPLIT = 16


@triton.jit
def _tile_rows(slots_ptr, order_ptr, T, pm, ORDERED: tl.constexpr, BLOCK_M: tl.constexpr):
    """The tile's positions (into h), its rows (into x and out) and their slots (0 past T)."""
    offs_m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    in_t = offs_m < T
    if ORDERED:  # noqa: SIM108 (a constexpr branch, kept as a plain if for Triton)
        rows = tl.load(order_ptr + offs_m, mask=in_t, other=0).to(tl.int64)
    else:
        rows = offs_m.to(tl.int64)
    s = tl.load(slots_ptr + rows, mask=in_t, other=0)
    return offs_m.to(tl.int64), rows, s


@triton.jit(do_not_specialize=["T"])
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, order_ptr, h_ptr, T, K, W, K_PER_SPLIT,
                   stride_xt, stride_xk, stride_as, stride_aw, stride_ak, stride_hs, stride_ht,
                   ORDERED: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr):
    wb = tl.program_id(0)  # fastest: the W blocks of one tile run together and share its x in L2
    pm = tl.program_id(1)
    ks = tl.program_id(2)  # which split of K: its partial sum goes to h[ks]
    offs_m, rows, s = _tile_rows(slots_ptr, order_ptr, T, pm, ORDERED, BLOCK_M)
    offs_w = wb * BLOCK_W + tl.arange(0, BLOCK_W)
    w_in = offs_w < W
    k_lo = ks * K_PER_SPLIT  # a multiple of BLOCK_K
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    h_base = h_ptr + ks.to(tl.int64) * stride_hs
    slot = tl.min(tl.where(s > 0, s, _NO_SLOT), axis=0)
    while slot < _NO_SLOT:
        sel = s == slot
        a_base = a_ptr + slot.to(tl.int64) * stride_as
        acc = tl.zeros((BLOCK_M, BLOCK_W), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_in = offs_k < K
            xt = tl.load(x_ptr + rows[:, None] * stride_xt + offs_k[None, :] * stride_xk,
                         mask=sel[:, None] & k_in[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            at = tl.load(a_base + offs_k[:, None] * stride_ak + offs_w[None, :] * stride_aw,
                         mask=k_in[:, None] & w_in[None, :], other=0.0)  # [BLOCK_K, BLOCK_W]
            acc = tl.dot(xt, at, acc, input_precision=PRECISION)
        tl.store(h_base + offs_m[:, None] * stride_ht + offs_w[None, :], acc, mask=sel[:, None] & w_in[None, :])
        slot = tl.min(tl.where(s > slot, s, _NO_SLOT), axis=0)


@triton.jit(do_not_specialize=["T", "SPLIT"])
def _expand_kernel(h_ptr, b_ptr, slots_ptr, order_ptr, out_ptr, T, N, R, E0, E1, E2, SPLIT,
                   stride_hs, stride_ht, stride_bs, stride_bn, stride_bw, stride_ot, stride_on,
                   ORDERED: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    nb = tl.program_id(0)
    pm = tl.program_id(1)
    offs_m, rows, s = _tile_rows(slots_ptr, order_ptr, T, pm, ORDERED, BLOCK_M)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = offs_n < N
    # Each output's part (E0..E2: the ends of parts 0..2); the block holds parts p_lo..p_hi (one
    # but where it straddles a part end). Part p's outputs read its rank columns [p*R, p*R + R),
    # BLOCK_R at a time, masked per output only (so the loads of B stay vectorized along them).
    part = (offs_n >= E0).to(tl.int32) + (offs_n >= E1).to(tl.int32) + (offs_n >= E2).to(tl.int32)
    p_lo = tl.min(tl.where(n_in, part, _NO_SLOT), axis=0)
    p_hi = tl.max(tl.where(n_in, part, 0), axis=0)
    slot = tl.min(tl.where(s > 0, s, _NO_SLOT), axis=0)
    while slot < _NO_SLOT:
        sel = s == slot
        b_base = b_ptr + slot.to(tl.int64) * stride_bs
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for p in range(p_lo, p_hi + 1):
            p_out = n_in & (part == p)
            c_end = p * R + R
            for c in range(p * R, c_end, BLOCK_R):
                offs_c = c + tl.arange(0, BLOCK_R)
                c_in = offs_c < c_end
                h_ptrs = h_ptr + offs_m[:, None] * stride_ht + offs_c[None, :]
                h_mask = sel[:, None] & c_in[None, :]
                ht = tl.load(h_ptrs, mask=h_mask, other=0.0)  # [BLOCK_M, BLOCK_R], the shrink's partial sums
                for sp in range(1, SPLIT):
                    ht += tl.load(h_ptrs + sp * stride_hs, mask=h_mask, other=0.0)
                bt = tl.load(b_base + offs_c[:, None] * stride_bw + offs_n[None, :] * stride_bn,
                             mask=c_in[:, None] & p_out[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
                acc = tl.dot(ht.to(bt.dtype), bt, acc, input_precision=PRECISION)
        ptrs = out_ptr + rows[:, None] * stride_ot + offs_n[None, :] * stride_on
        mask = sel[:, None] & n_in[None, :]
        prev = tl.load(ptrs, mask=mask, other=0.0)
        tl.store(ptrs, (prev.to(tl.float32) + acc).to(prev.dtype), mask=mask)
        slot = tl.min(tl.where(s > slot, s, _NO_SLOT), axis=0)


def _pow2_between(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(n, 1))))


def lora_shrink_expand(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor,
                       out: torch.Tensor, order: torch.Tensor | None = None,
                       parts: Sequence[int] | None = None) -> None:
    """``out[t] += (x[t] @ a[s]^T) @ b[s]^T`` for every row t with slot ``s = token_slots[t] > 0``
    (in place). x [T, in], a [S, W, in], b [S, out, W], token_slots [T] int32, out [T, out].

    ``order`` [T] (int32 / int64): a permutation of the rows, best the rows sorted by slot (any
    permutation gives the same result; sorted, a tile holds fewer slots). ``parts``: the output
    sizes of the layer's fused parts (summing to out), B block-diagonal over ``W / len(parts)``
    rank columns each; the expand then reads only each part's columns. None: one part."""
    T, K = x.shape
    W, N = a.shape[1], b.shape[1]
    if T == 0:
        return
    num_parts = len(parts) if parts else 1
    if num_parts > _MAX_PARTS or W % num_parts:
        num_parts = 1  # read all W columns: the block-diagonal zeros make it right, only slower
    if num_parts > 1:
        assert parts is not None and sum(parts) == N, (parts, N)
        ends = [sum(parts[: i + 1]) for i in range(num_parts - 1)]
    else:
        ends = []
    ends += [_NONE] * (3 - len(ends))
    rank = W // num_parts
    ordered = order is not None
    order_arg = order if order is not None else token_slots  # not read when not ordered
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # tf32: the default, unused for 16-bit
    block_m = _pow2_between(triton.cdiv(T, 128), 16, 64)  # small tiles until there are ~128 of them
    block_w, block_k = _pow2_between(W, 16, 64), 64
    tiles, w_blocks, k_blocks = triton.cdiv(T, block_m), triton.cdiv(W, block_w), triton.cdiv(K, block_k)
    # Few tiles (decode): split K too, up to ~256 programs and down to 4 K blocks each; each split
    # writes its partial sums to h[split], which the expand adds up (no atomics: deterministic).
    split = 1
    while tiles * w_blocks * split * 2 <= _SHRINK_PROGRAMS and split * 2 <= min(_MAX_SPLIT, k_blocks // 4):
        split *= 2
    k_per_split = triton.cdiv(k_blocks, split) * block_k
    h = torch.empty(split, T, W, dtype=torch.float32, device=x.device)  # rows of slot 0 are never read
    _shrink_kernel[(w_blocks, tiles, split)](
        x, a, token_slots, order_arg, h, T, K, W, k_per_split, x.stride(0), x.stride(1), a.stride(0), a.stride(1),
        a.stride(2), h.stride(0), h.stride(1), ORDERED=ordered, PRECISION=precision, BLOCK_M=block_m,
        BLOCK_W=block_w, BLOCK_K=block_k, num_warps=4)
    block_n = _pow2_between(N, 16, 128)
    _expand_kernel[(triton.cdiv(N, block_n), tiles)](
        h, b, token_slots, order_arg, out, T, N, rank, ends[0], ends[1], ends[2], split, h.stride(0), h.stride(1),
        b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1), ORDERED=ordered, PRECISION=precision,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=_pow2_between(rank, 16, 64), num_warps=4)
