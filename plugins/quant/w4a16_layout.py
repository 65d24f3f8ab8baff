"""The one packed layout Loom's GPU kernels read, and the repacking of GPTQ, AWQ and NF4 into it.

For a layer ``y = x @ W^T`` with ``W [N, K]`` (N outputs, K inputs):

- ``qweight`` int32 ``[K / f, N]``, ``f = 32 / bits``: the codes of ``W^T`` packed along K, input
  ``r*f + j`` of column n in bits ``j*bits ..`` of word ``(r, n)`` (GPTQ's own ``qweight`` layout:
  a GPTQ checkpoint without act-order is used as it is). A kernel tile reads whole words along K
  and the N columns of a word row are contiguous, so loads coalesce along N.
- ``scales`` ``[G, N]`` in the activations' dtype; input k (in the kernel's order) is in group
  ``k // group_size`` (one group of K inputs for per-channel checkpoints).
- integer codes: ``zeros`` ``[G, N]`` in the activations' dtype, ``w = (q - zero) * scale``;
  NF4: a 16-value ``table`` (float32), ``w = table[q] * scale`` (the scale is the block's absmax,
  a block of 64 along K being a group of 64).
- act-order: GPTQ's ``g_idx`` puts inputs of one group anywhere in K. At load the inputs are
  sorted by group once (``perm``: the kernel's k-th input is the layer's input ``perm[k]``), so
  groups are contiguous again and the kernels gather ``x[:, perm]`` as they load it. This needs
  every group to hold exactly ``group_size`` inputs (what GPTQ writes); other ``g_idx`` keep the
  checkpoint's layout and the dequantizing path. A row-parallel rank's act-order slice of K
  (``g_idx`` naming global groups, every group's scales kept) repacks only when it holds whole
  groups (those groups' scales are kept); parts of groups keep the dequantizing path.

A fused layer whose parts disagree on ``perm`` (or NF4 ``table``) is split into column
*segments*, one kernel launch each; usually there is one segment.

Everything here is plain torch, device-agnostic and tested on the CPU; the kernels are in
``w4a16_triton``. Repacking is exact: :meth:`W4A16Layout.dequantize` equals the checkpoint's
float32 dequantization when the scales survive the activation dtype (fp16 and fp32 ones do;
bf16 rounds them to 8 significant bits, as every bf16 W4A16 kernel does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .int_packing import per_word, unpack_rows

_SHIFT_CHUNK = 1 << 22  # words packed per chunk: bounds the int32 temporaries of a large layer


class NotRepackable(ValueError):
    """The checkpoint's layer cannot be put in the kernel layout (it keeps the dequantizing path)."""


@dataclass
class Segment:
    """Output columns ``start:end`` of the layer, computed by one kernel launch."""

    start: int
    end: int
    perm: torch.Tensor | None = None  # [K] int32: the kernel's input k is the layer's input perm[k]
    table: torch.Tensor | None = None  # [16] float32: NF4 code -> value (None: integer codes)


@dataclass
class W4A16Layout:
    """A layer's weight in the kernel layout (the tensors are also the layer's buffers)."""

    qweight: torch.Tensor  # [K / f, N] int32
    scales: torch.Tensor  # [G, N] activation dtype
    zeros: torch.Tensor | None  # [G, N] activation dtype (integer codes); None for NF4
    bits: int
    group_size: int  # inputs per group (K for one group per output channel)
    in_features: int
    segments: list[Segment]

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    def register(self, layer: nn.Module) -> None:
        """Make the tensors the layer's buffers (so memory accounting and ``.to()`` see them) and
        attach the layout as ``layer.w4a16``."""
        layer.register_buffer("w4a16_qweight", self.qweight)
        layer.register_buffer("w4a16_scales", self.scales)
        if self.zeros is not None:
            layer.register_buffer("w4a16_zeros", self.zeros)
        for i, seg in enumerate(self.segments):
            if seg.perm is not None:
                layer.register_buffer(f"w4a16_perm_{i}", seg.perm)
            if seg.table is not None:
                layer.register_buffer(f"w4a16_table_{i}", seg.table)
        layer.__dict__["w4a16"] = self

    def codes(self) -> torch.Tensor:
        """``[K, N]`` int32 codes in the kernel's input order."""
        return unpack_rows(self.qweight, self.bits)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """``W [N, K]`` in the layer's input order: float32 products, then ``dtype`` (what the
        kernels compute, and the torch path when they are switched off)."""
        q = self.codes()  # [K, N]
        k = torch.arange(self.in_features, device=q.device)
        g = k // self.group_size
        wt = torch.empty(q.shape, dtype=torch.float32, device=q.device)  # W^T in the layer's order
        for seg in self.segments:
            cols = slice(seg.start, seg.end)
            qs = q[:, cols]
            values = seg.table.float()[qs.long()] if seg.table is not None else \
                qs.float() - self._zeros()[g, cols].float()
            block = values * self.scales[g, cols].float()
            if seg.perm is None:
                wt[:, cols] = block
            else:
                wt[seg.perm.long(), cols] = block
        return wt.t().to(dtype)

    def _zeros(self) -> torch.Tensor:
        assert self.zeros is not None, "an NF4 layout has no zero points"
        return self.zeros

    def nbytes(self) -> int:
        total = self.qweight.nbytes + self.scales.nbytes + (self.zeros.nbytes if self.zeros is not None else 0)
        for seg in self.segments:
            total += sum(t.nbytes for t in (seg.perm, seg.table) if t is not None)
        return total


def pack_rows_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``[R, C]`` codes in ``[0, 2^bits)`` -> ``[R / f, C]`` int32 words (row ``r*f + j`` in bits
    ``j*bits``), as :func:`int_packing.pack_rows` but with int32 temporaries only, in chunks
    (a large layer repacks on the GPU without gigabytes of int64)."""
    f = per_word(bits)
    rows, cols = values.shape
    if rows % f:
        raise ValueError(f"{rows} rows do not fill whole words of {f}")
    out = torch.empty(rows // f, cols, dtype=torch.int32, device=values.device)
    step = max(1, _SHIFT_CHUNK // max(cols, 1))
    for r0 in range(0, rows // f, step):
        r1 = min(r0 + step, rows // f)
        chunk = values[r0 * f:r1 * f].to(torch.int32).contiguous().view(r1 - r0, f, cols)
        word = chunk[:, 0].clone()
        for j in range(1, f):
            # left shifts of int32 wrap: the top code lands in the sign bit, as in the checkpoint
            word |= chunk[:, j] << (j * bits)
        out[r0:r1] = word
    return out


def group_permutation(g_idx: torch.Tensor, group_size: int, groups: int) -> torch.Tensor | None:
    """The input order that makes act-order groups contiguous: ``perm`` with
    ``g_idx[perm[k]] == k // group_size`` for every k (None when ``g_idx`` is already that,
    i.e. no reordering is needed); NotRepackable when a group does not hold exactly
    ``group_size`` inputs."""
    g = g_idx.long()
    k = g.numel()
    expected = torch.arange(k, device=g.device) // group_size
    if torch.equal(g, expected):
        return None
    counts = torch.bincount(g, minlength=groups)
    if counts.numel() != groups or bool((counts != group_size).any()):
        raise NotRepackable(f"g_idx groups do not each hold {group_size} inputs")
    return torch.sort(g, stable=True).indices.to(torch.int32)


def from_int_codes(codes: torch.Tensor | None, zeros: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
                   part_rows: list[int], g_idx: torch.Tensor | None, dtype: torch.dtype,
                   packed: torch.Tensor | None = None) -> W4A16Layout:
    """GPTQ / AWQ codes in the kernel layout.

    ``codes [K, N]`` int (the checkpoint's input order); ``zeros`` / ``scales`` ``[G, N]``
    (the actual zero, not GPTQ v1's zero - 1); ``part_rows``: the output columns of each fused
    part; ``g_idx [parts, K]`` (act-order) or None; ``packed``: ``codes`` already packed as
    ``[K / f, N]`` words (a GPTQ qweight without act-order: reused as it is).
    """
    if packed is not None:
        k, n = packed.shape[0] * per_word(bits), int(packed.shape[1])
    elif codes is not None:
        k, n = int(codes.shape[0]), int(codes.shape[1])
    else:
        raise ValueError("from_int_codes needs the codes or their packed words")
    gs = k if group_size == -1 else group_size
    groups = int(scales.shape[0])
    perms: list[torch.Tensor | None] = []
    if g_idx is not None and k < groups * gs:
        g_idx, zeros, scales = _whole_groups_of_slice(g_idx, zeros, scales, gs, k)
        groups = int(scales.shape[0])
    if g_idx is not None:
        perms = [group_permutation(g_idx[i], gs, groups) for i in range(len(part_rows))]
    if not perms or all(p is None for p in perms):
        if packed is not None:
            qweight = packed
        else:
            assert codes is not None
            qweight = pack_rows_int32(codes, bits)
        segments = [Segment(0, n)]
    else:
        if codes is None:
            raise ValueError("act-order repacking needs the unpacked codes")
        ordered = torch.empty_like(codes, dtype=torch.int32)
        segments, start = [], 0
        for rows, perm in zip(part_rows, perms, strict=True):
            cols = slice(start, start + rows)
            ordered[:, cols] = codes[:, cols] if perm is None else codes[perm.long(), cols]
            segments.append(Segment(start, start + rows, perm))
            start += rows
        segments = _merge(segments)
        qweight = pack_rows_int32(ordered, bits)
    return W4A16Layout(qweight=qweight.contiguous(), scales=scales.to(dtype).contiguous(),
                       zeros=zeros.to(dtype).contiguous(), bits=bits, group_size=gs, in_features=k,
                       segments=segments)


def _whole_groups_of_slice(g_idx: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                           k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A row-parallel rank's act-order slice: ``g_idx [parts, k]`` names global groups and
    ``zeros`` / ``scales`` ``[G, N]`` hold every group (``k < G * group_size``). The kernels group
    input k as ``k // group_size``, so the slice repacks only when it holds whole groups, and the
    same ones in every part (``g0 .. g0 + k / group_size``): then those groups' rows and
    ``g_idx - g0``. NotRepackable otherwise (the usual act-order case: parts of many groups)."""
    g = g_idx.long()
    first = int(g.min())
    local = k // group_size
    if k % group_size or int(g.max()) != first + local - 1:
        raise NotRepackable(f"a tensor-parallel rank's {k} inputs hold parts of act-order groups of {group_size}")
    counts = torch.stack([torch.bincount(row - first, minlength=local) for row in g])  # [parts, local]
    if bool((counts != group_size).any()):
        raise NotRepackable(f"a tensor-parallel rank's {k} inputs hold parts of act-order groups of {group_size}")
    rows = slice(first, first + local)
    return (g - first).to(g_idx.dtype), zeros[rows], scales[rows]


def from_nf4_parts(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, tuple[int, int]]],
                   dtype: torch.dtype) -> W4A16Layout:
    """NF4 parts ``(packed uint8 [rows*K/2], absmax float32 [rows*K/blocksize], table [16],
    blocksize, (rows, K))`` (bitsandbytes' order: row-major blocks, first code in the high nibble)
    in the kernel layout; NotRepackable when a block would straddle two rows."""
    k = parts[0][4][1]
    blocksize = parts[0][3]
    codes, absmax, segments, start = [], [], [], 0
    for packed, amax, table, bs, (rows, cols) in parts:
        if bs != blocksize or cols != k or cols % bs:
            raise NotRepackable(f"NF4 blocks of {bs} over rows of {cols} inputs do not tile each row")
        flat = packed.reshape(-1)
        pair = torch.stack([flat >> 4, flat & 0xF], dim=1).reshape(rows, cols)  # [rows, K] uint8
        codes.append(pair)
        absmax.append(amax.reshape(rows, cols // bs))
        segments.append(Segment(start, start + rows, table=table.float().reshape(16).contiguous()))
        start += rows
    qweight = pack_rows_int32(torch.cat(codes).t(), 4)  # [K / 8, N]
    scales = torch.cat(absmax).t().to(dtype).contiguous()  # [K / blocksize, N]
    return W4A16Layout(qweight=qweight, scales=scales, zeros=None, bits=4, group_size=blocksize, in_features=k,
                       segments=_merge(segments))


def _merge(segments: list[Segment]) -> list[Segment]:
    """Neighbouring segments with the same perm and table become one (one launch)."""
    merged = [segments[0]]
    for seg in segments[1:]:
        last = merged[-1]
        if _same(last.perm, seg.perm) and _same(last.table, seg.table):
            merged[-1] = Segment(last.start, seg.end, last.perm, last.table)
        else:
            merged.append(seg)
    return merged


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and bool(torch.equal(a, b))
