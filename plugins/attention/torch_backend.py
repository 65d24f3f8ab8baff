"""The ``torch`` attention backend: ``scaled_dot_product_attention`` over the paged KV cache.

Runs wherever PyTorch does and is the reference the other backends are checked against, and
the CPU fast path. One step is planned once, in :meth:`TorchAttentionBackend.prepare` (which
rows decode, which prefill, the gather indices; masks are added on first use), and all layers of
the model reuse the plan. Per layer the work is then:

* write the new K/V into the pool at ``slot_mapping``;
* the pure-decode sequences (``query_len == 1``): in fp32 on the CPU, one call of a compiled
  kernel that reads their keys and values in place from the pool (``cpu_kernels.py``: 4-12x
  faster than the gather below, which it falls back to when it cannot be built). Otherwise in a
  few groups of similar length: each group's blocks are gathered into one padded
  ``[Bd, Hkv, L, D]`` batch for a single SDPA call, with an additive mask hiding padding.
  Grouping by length bounds the padding: with lengths from 16 to 768 in one batch (C2), one
  group gathered and attended over about twice the real keys;
* each prefill sequence (``query_len > 1``) with its own SDPA call: plain causal when it has no
  cached context, otherwise an explicit bottom-right-aligned causal mask over its gathered K/V.

Soft-capped scores (Gemma 2: ``cap * tanh(scale * q.k / cap)`` before the mask) cannot go
through SDPA nor the compiled kernel: such layers compute the scores, the cap, the softmax (in
float32) and the weighted sum with plain matmuls over the same gathered K/V, in transformers'
order of operations.

An FP8 pool (``--kv-cache-dtype fp8``, ``loom.layers.kv_fp8``): new K/V are quantized as they are
written; the gathers above dequantize the blocks they read to the compute dtype, and a prefill
without cached context attends over its own K/V quantized and dequantized, the values a later
step reads back (so chunking and the prefix cache do not change a request's output).

A sequence's result does not depend on the rest of the batch beyond float rounding: padding keys
get weight exactly 0 (the pool holds only finite values, so 0 * stale value is 0), but SDPA's CPU
kernel may order its sums differently for other batch shapes (differences of ~1 ulp seen).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from loom.plugin_api import AttentionBackend, AttentionMetadata, kv_fp8, write_kv

from . import cpu_kernels

_MaskKey = tuple[int | None, torch.dtype]

# SDPA's enable_gqa arrived in torch 2.5; on older versions prefill expands K/V instead.
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass
class _DecodeGroup:
    """``query_len == 1`` sequences of similar length, attended in one padded batch."""

    num_seqs: int
    # Their token rows: a (start, stop) slice when they are consecutive, else an index tensor.
    row_slice: tuple[int, int] | None
    row_index: torch.Tensor | None  # [Bd] int64
    tables: torch.Tensor  # [Bd, nblk] int32, contiguous: the blocks each sequence reads
    blocks_per_seq: int  # nblk: enough blocks for the longest sequence of the group
    padded_len: int  # L: the longest sequence's length; shorter ones are padded to it
    seq_lens: torch.Tensor  # [Bd] int32, on device
    masks: dict[_MaskKey, torch.Tensor] = field(default_factory=dict)  # [Bd, 1, 1, L] additive


@dataclass
class _Prefill:
    """One ``query_len > 1`` sequence."""

    start: int  # its token rows are start:start + query_len
    query_len: int
    seq_len: int
    block_ids: torch.Tensor | None  # [nblk] blocks holding its K/V; None without cached context
    masks: dict[_MaskKey, torch.Tensor | None] = field(default_factory=dict)  # [Lq, Lk] or None

    @property
    def context_len(self) -> int:
        return self.seq_len - self.query_len


@dataclass
class StepPlan:
    """The torch backend's plan of one step, shared by all layers."""

    decodes: list[_DecodeGroup]
    prefills: list[_Prefill]
    # [W] int64: the rows whose K/V are written, when some have slot -1 (CPU only); None: all
    written: torch.Tensor | None = None

# A decode group ends where the next sequence is shorter than this share of the group's longest
# (so a group attends over at most about 1 / _GROUP_SHARE times its real keys), unless the group
# is still smaller than _MIN_GROUP sequences (an SDPA call per tiny group costs more than its
# padding). Measured on C2 (lengths 16..768, 2 CPU threads): one group 145 s, (0.6, 8) 121 s,
# (0.75, 4) 109 s.
_GROUP_SHARE = 0.75
_MIN_GROUP = 4


def _length_groups(dec_seqs: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Decode sequences (step indices) split into groups of similar length, longest first."""
    if len(dec_seqs) <= _MIN_GROUP:
        return [dec_seqs]
    order = sorted(dec_seqs, key=lambda i: -seq_lens[i])
    groups: list[list[int]] = [[order[0]]]
    for i in order[1:]:
        head = seq_lens[groups[-1][0]]
        if len(groups[-1]) >= _MIN_GROUP and seq_lens[i] < _GROUP_SHARE * head:
            groups.append([i])
        else:
            groups[-1].append(i)
    if len(groups) > 1 and len(groups[-1]) < _MIN_GROUP:  # no tiny tail group
        tail = groups.pop()
        groups[-1] += tail
    return [sorted(g) for g in groups]  # step order inside a group: rows stay a slice when they can


def plan_step(meta: AttentionMetadata, split_by_length: bool = True) -> StepPlan:
    """Split the step into decode groups and prefills, from host-side lists only. Without
    ``split_by_length`` (the in-place kernel pads nothing) all decodes form one group."""
    bs = meta.block_size
    device = meta.block_tables.device
    starts: list[int] = []
    acc = 0
    for ql in meta.query_lens_cpu:
        starts.append(acc)
        acc += ql

    dec_seqs = [i for i, ql in enumerate(meta.query_lens_cpu) if ql == 1]
    decodes: list[_DecodeGroup] = []
    groups = _length_groups(dec_seqs, meta.seq_lens_cpu) if split_by_length else [dec_seqs]
    for members in groups if dec_seqs else []:
        nd = len(members)
        max_len = max(meta.seq_lens_cpu[i] for i in members)
        nblk = -(-max_len // bs)
        if nblk > meta.block_tables.shape[1]:
            raise ValueError(f"block_tables has {meta.block_tables.shape[1]} columns, need {nblk}")
        if members == list(range(meta.num_seqs)):  # the common pure-decode step: no row selection
            tables = meta.block_tables[:, :nblk]
            seq_lens = meta.seq_lens
        else:
            seq_idx = torch.tensor(members, dtype=torch.int64, device=device)
            tables = meta.block_tables.index_select(0, seq_idx)[:, :nblk]
            seq_lens = meta.seq_lens.index_select(0, seq_idx)
        rows = [starts[i] for i in members]
        consecutive = rows == list(range(rows[0], rows[0] + nd))
        decodes.append(_DecodeGroup(
            num_seqs=nd,
            row_slice=(rows[0], rows[0] + nd) if consecutive else None,
            row_index=None if consecutive else torch.tensor(rows, dtype=torch.int64, device=device),
            # Padding columns of a short sequence point at whatever block the table holds there
            # (0 by default): readable memory whose keys the mask then hides.
            tables=tables.to(torch.int32).contiguous(),
            blocks_per_seq=nblk,
            padded_len=max_len,
            seq_lens=seq_lens,
        ))

    prefills: list[_Prefill] = []
    for i, ql in enumerate(meta.query_lens_cpu):
        if ql <= 1:
            continue
        sl = meta.seq_lens_cpu[i]
        block_ids = meta.block_tables[i, : -(-sl // bs)] if sl > ql else None
        prefills.append(_Prefill(start=starts[i], query_len=ql, seq_len=sl, block_ids=block_ids))
    return StepPlan(decodes=decodes, prefills=prefills)


def _decode_mask(group: _DecodeGroup, sliding_window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """[Bd, 1, 1, L] additive mask: 0 for each sequence's valid keys, -inf elsewhere."""
    key = (sliding_window, dtype)
    mask = group.masks.get(key)
    if mask is None:
        pos = torch.arange(group.padded_len, device=group.seq_lens.device)  # [L]
        lens = group.seq_lens.to(torch.int64)[:, None]  # [Bd, 1]
        valid = pos[None, :] < lens  # [Bd, L]
        if sliding_window is not None:
            # HF semantic: the query at position lens-1 sees keys p > (lens-1) - window.
            valid &= pos[None, :] >= lens - sliding_window
        mask = torch.zeros(valid.shape, dtype=dtype, device=valid.device)
        mask.masked_fill_(~valid, float("-inf"))
        mask = mask[:, None, None, :]
        group.masks[key] = mask
    return mask


def _prefill_mask(
    pre: _Prefill, sliding_window: int | None, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """[Lq, Lk] additive mask, or None when plain ``is_causal`` is exact (no context, no window)."""
    key = (sliding_window, dtype)
    if key in pre.masks:
        return pre.masks[key]
    mask: torch.Tensor | None = None
    if pre.context_len > 0 or sliding_window is not None:
        q_pos = pre.context_len + torch.arange(pre.query_len, device=device)[:, None]  # [Lq, 1]
        k_pos = torch.arange(pre.seq_len, device=device)[None, :]  # [1, Lk]
        valid = k_pos <= q_pos  # [Lq, Lk]
        if sliding_window is not None:
            valid &= k_pos > q_pos - sliding_window
        mask = torch.zeros(valid.shape, dtype=dtype, device=device)
        mask.masked_fill_(~valid, float("-inf"))
    pre.masks[key] = mask
    return mask


def _capped_attention(
    q: torch.Tensor,  # [B, H, Lq, D]
    keys: torch.Tensor,  # [B, H, Lk, D]
    values: torch.Tensor,  # [B, H, Lk, D]
    mask: torch.Tensor | None,  # additive, broadcast to [B, H, Lq, Lk]; None: causal (Lq == Lk)
    scale: float,
    cap: float,
) -> torch.Tensor:  # [B, H, Lq, D]
    """Attention with soft-capped scores, as transformers' eager Gemma 2 computes it."""
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    if mask is None:
        lq, lk = scores.shape[-2:]
        causal = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
        mask = torch.zeros(lq, lk, dtype=scores.dtype, device=q.device).masked_fill_(~causal, float("-inf"))
    probs = torch.softmax(scores + mask, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, values)


class TorchAttentionBackend(AttentionBackend[StepPlan]):
    """Paged attention with ``torch.nn.functional.scaled_dot_product_attention``.

    Slot ``-1`` in ``slot_mapping`` skips that row's write on the CPU (a draft model's catch-up
    rows laid out for a graph width, run eagerly by the tests: ``draft_catch_up``); on a GPU it
    is not supported (finding the rows would wait for the device, and this backend captures no
    graphs, which are what pad steps there): every new token's K/V is written.
    """

    name = "torch"
    supports_logits_soft_cap = True
    supports_fp8_kv_cache = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, dtype, device)
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.group_size = num_heads // num_kv_heads
        # fp32 decode on the CPU reads the pool in place (cpu_kernels.py) when the kernel builds
        self.cpu_kernel = (device.type == "cpu" and dtype == torch.float32
                           and cpu_kernels.cpu_decode_kernel_available())

    def use_fp8_kv_cache(self) -> None:
        super().use_fp8_kv_cache()
        self.cpu_kernel = False  # the in-place CPU kernel reads float32 pools only

    def prepare(self, meta: AttentionMetadata) -> StepPlan:
        # The in-place CPU kernel pads nothing: its decodes need no split by length.
        plan = plan_step(meta, split_by_length=not self.cpu_kernel)
        slots = meta.slot_mapping
        if slots.device.type == "cpu" and slots.numel() and int(slots.min()) < 0:
            plan.written = (slots >= 0).nonzero().squeeze(1)
        return plan

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        plan: StepPlan,
        scale: float,
        sliding_window: int | None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:  # [T, Hq, D]
        cap = logits_soft_cap
        # (1) Write the new K/V: the pool viewed as flat slots [num_blocks * block_size, Hkv, D].
        new_k, new_v, slots = k, v, meta.slot_mapping
        if plan.written is not None:  # rows of slot -1 write nothing
            new_k, new_v, slots = k[plan.written], v[plan.written], slots[plan.written]
        if self.fp8_kv_cache:
            kv_fp8.write(new_k, new_v, kv_cache, slots)
        elif self.cpu_kernel:
            cpu_kernels.write_kv(new_k, new_v, kv_cache, slots)
        else:
            write_kv(new_k, new_v, kv_cache, slots)

        if len(plan.decodes) == 1 and not plan.prefills and plan.decodes[0].row_slice == (0, q.shape[0]):
            return self._decode(q, kv_cache, plan.decodes[0], scale, sliding_window, cap)

        out = torch.empty_like(q)  # [T, Hq, D]
        for group in plan.decodes:
            if group.row_slice is not None:
                lo, hi = group.row_slice
                out[lo:hi] = self._decode(q[lo:hi], kv_cache, group, scale, sliding_window, cap)
            else:
                assert group.row_index is not None
                dec_q = q.index_select(0, group.row_index)
                out.index_copy_(0, group.row_index,
                                self._decode(dec_q, kv_cache, group, scale, sliding_window, cap))
        for pre in plan.prefills:
            lo, hi = pre.start, pre.start + pre.query_len
            out[lo:hi] = self._prefill(q[lo:hi], k[lo:hi], v[lo:hi], kv_cache, pre, scale, sliding_window, cap)
        return out

    def _read_blocks(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Blocks ``block_ids [n]`` of the pool: ``[2, n, bs, Hkv, D]`` (dequantized from FP8)."""
        if self.fp8_kv_cache:
            return kv_fp8.read_blocks(kv_cache, block_ids, dtype)
        return kv_cache.index_select(1, block_ids)

    def _decode(
        self,
        q: torch.Tensor,  # [Bd, Hq, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        group: _DecodeGroup,
        scale: float,
        sliding_window: int | None,
        cap: float | None = None,
    ) -> torch.Tensor:  # [Bd, Hq, D]
        if self.cpu_kernel and cap is None:  # fp32 on the CPU (the backend's device and dtype)
            return cpu_kernels.paged_decode_attention(q.contiguous(), kv_cache, group.tables,
                                                      group.seq_lens, scale, sliding_window)
        bd, hkv, d, g = group.num_seqs, self.num_kv_heads, self.head_dim, self.group_size
        # One gather for K and V together, whole blocks at a time (far fewer, larger copies than
        # gathering slot by slot).
        kv = self._read_blocks(kv_cache, group.tables.view(-1), q.dtype)  # [2, Bd * nblk, bs, Hkv, D]
        kv = kv.view(2, bd, group.blocks_per_seq * kv_cache.shape[2], hkv, d)
        kv = kv[:, :, : group.padded_len]  # [2, Bd, L, Hkv, D]
        keys = kv[0].transpose(1, 2)  # [Bd, Hkv, L, D] (strided view; SDPA reads it in place)
        values = kv[1].transpose(1, 2)  # [Bd, Hkv, L, D]
        # GQA without expanding K/V: the g query heads sharing a KV head (HF order: head h uses
        # KV head h // g) become g query rows of that head. One query token per sequence, so
        # all rows share the sequence's padding mask.
        qg = q.reshape(bd, hkv, g, d)  # [Bd, Hkv, g, D]
        mask = _decode_mask(group, sliding_window, q.dtype)  # [Bd, 1, 1, L]
        if cap is not None:
            out = _capped_attention(qg, keys, values, mask, scale, cap)
        else:
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
        return out.reshape(bd, hkv * g, d)  # [Bd, Hq, D]

    def _prefill(
        self,
        q: torch.Tensor,  # [Lq, Hq, D]
        k: torch.Tensor,  # [Lq, Hkv, D]
        v: torch.Tensor,  # [Lq, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        pre: _Prefill,
        scale: float,
        sliding_window: int | None,
        cap: float | None = None,
    ) -> torch.Tensor:  # [Lq, Hq, D]
        if pre.block_ids is None:
            # No cached context: the new K/V are the whole sequence; no need to read the pool.
            keys, values = k, v  # [Lk, Hkv, D]
            if self.fp8_kv_cache:  # ... but as the pool holds them, as later steps will read them
                keys, values = kv_fp8.round_trip(k), kv_fp8.round_trip(v)
        else:
            kv = self._read_blocks(kv_cache, pre.block_ids, q.dtype)  # [2, nblk, bs, Hkv, D]
            kv = kv.view(2, -1, self.num_kv_heads, self.head_dim)[:, : pre.seq_len]  # [2, Lk, Hkv, D]
            keys, values = kv[0], kv[1]
        mask = _prefill_mask(pre, sliding_window, q.dtype, q.device)  # [Lq, Lk] or None
        if cap is not None:
            if self.group_size > 1:
                keys = keys.repeat_interleave(self.group_size, dim=1)  # [Lk, Hq, D]
                values = values.repeat_interleave(self.group_size, dim=1)
            out = _capped_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                    values.transpose(0, 1)[None], mask, scale, cap)  # [1, Hq, Lq, D]
            return out[0].transpose(0, 1)
        gqa = self.group_size > 1
        if gqa and not _SDPA_HAS_GQA:
            keys = keys.repeat_interleave(self.group_size, dim=1)  # [Lk, Hq, D]
            values = values.repeat_interleave(self.group_size, dim=1)
            gqa = False
        extra = {"enable_gqa": True} if gqa else {}
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],  # [1, Hq, Lq, D]
            keys.transpose(0, 1)[None],  # [1, Hkv, Lk, D] (Hq when expanded)
            values.transpose(0, 1)[None],  # [1, Hkv, Lk, D]
            attn_mask=mask,
            is_causal=mask is None,  # Lq == Lk here, so top-left causal is the right alignment
            scale=scale,
            **extra,
        )  # [1, Hq, Lq, D]
        return out[0].transpose(0, 1)  # [Lq, Hq, D]
