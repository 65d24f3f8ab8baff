"""The ``paged`` attention backend: Triton kernels over the paged KV pool (CUDA only).

Per layer: one launch writes the new K/V into the pool (:func:`store_kv`; with the layer's RoPE
handed over unapplied, :func:`rope_store` rotates q and k in the same launch), then attention reads
every key, cached and new alike, from the pool through the block tables
(:func:`paged_attention`). How a step is served depends only on host-side values of the
metadata, planned once per step by :meth:`PagedAttentionBackend.prepare` (all layers reuse
the plan):

* pure decode (every sequence has one query token): one decode launch over all sequences, with
  split-K when there are too few (sequence, KV head) programs to fill the GPU. This path creates
  no tensor from host data and reads nothing on the host but ``num_seqs``, ``max_query_len``
  and ``max_seq_len``, so it can be captured in a CUDA graph (``max_seq_len`` then being the
  graph's upper bound; it only picks the split count).
* only prefills (query lengths > 1): one launch with 64-row query tiles over all sequences. The
  kernel reads each sequence's query range and context length from the device-side
  ``query_start_loc`` and ``seq_lens``, so a step whose every sequence has the same query
  length ``q > 1`` on cached context (verification of ``q - 1`` draft tokens) is planned from
  ``num_seqs`` and ``max_query_len`` alone, creates no tensor, and can be captured too.
* mixed: the decode sequences get the decode launch and the others the prefill launch, each
  told which sequences it serves through a small index tensor. Decode rows thereby keep 16-row
  tiles instead of occupying a 64-row prefill tile for one token.

Slot ``-1`` in ``slot_mapping`` skips the write of that token (CUDA-graph padding rows use it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from loom import kernel_switches
from loom.layers.rotary import PendingRope
from loom.layers.split_k import counters
from loom.plugin_api import AttentionBackend, AttentionMetadata, kv_fp8

from .decode_plans import choose_num_splits, plan_decode
from .triton_fp8_attention import paged_attention_fp8
from .triton_kernels import paged_attention, rope_store, store_kv

__all__ = ["PagedAttentionBackend", "PagedPlan", "choose_num_splits"]


@dataclass(frozen=True)
class PagedPlan:
    """Which launches serve a step: decode rows (one token) and the others, and how. The fields
    after ``num_splits`` shape the decode launch (``decode_plans.DecodePlan``); their defaults
    are the launcher's own."""

    decode_ids: torch.Tensor | None  # [nd] int32, None when every sequence decodes
    num_decode: int
    prefill_ids: torch.Tensor | None  # [np] int32, None when every sequence prefills
    num_prefill: int
    max_prefill_query_len: int
    num_splits: int
    min_keys: int = 0
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    fused_combine: bool = False
    max_registers: int | None = None  # the FP8 kernel's register cap a thread (decode_plans.DecodePlan)
    prefetch_table: bool = False  # the FP8 kernel's block-table prefetch (decode_plans.DecodePlan)


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def _ids_on(ids: list[int], device: torch.device) -> torch.Tensor:
    """int32 ids on ``device`` through pinned memory: a pageable copy would make the host wait
    for the GPU and stall asynchronous scheduling."""
    t = torch.tensor(ids, dtype=torch.int32)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class PagedAttentionBackend(AttentionBackend[PagedPlan]):
    """Triton paged attention: decode with GQA-grouped tiles and split-K, varlen prefill over
    cached context, sliding windows, soft-capped scores (Gemma 2); bf16/fp16 (fp32 works, with
    IEEE dots). The soft cap applies to float32 scores; the torch backend, like transformers'
    eager Gemma 2, caps scores rounded to the model's dtype, so the two differ by that rounding
    (tests/gpu/test_paged_attention.py::test_soft_capped_scores holds the kernel to a float32
    reference)."""

    name = "paged"
    supports_logits_soft_cap = True
    supports_fp8_kv_cache = True
    supports_rope_store = True  # RoPE and the K/V store in one launch (rope_store)
    supports_cuda_graphs = True
    supports_cuda_graphs_multi_token = True  # uniform query lengths: see prepare()

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, dtype, device)
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if head_dim < 16:
            raise ValueError(f"the paged backend needs head_dim >= 16, got {head_dim}")
        self.group_size = num_heads // num_kv_heads
        self._sms = 132  # an H100/H200; read off the device when there is one
        if device.type == "cuda":
            self._sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())

    def prepare(self, meta: AttentionMetadata) -> PagedPlan:
        """A pure decode, or a step whose every sequence has ``max_query_len`` tokens, is planned
        from ``num_seqs``, ``max_query_len`` and ``max_seq_len`` only and creates no tensor (what
        a CUDA graph needs); a mixed step indexes its two kinds of sequences from the host list."""
        n = meta.num_seqs
        if meta.is_pure_decode:
            d = plan_decode(n, self.num_kv_heads, self.group_size, self.head_dim, meta.max_seq_len, self._sms,
                            self.fp8_kv_cache)
            return PagedPlan(None, n, None, 0, 0, d.num_splits, d.min_keys, d.block_n, d.num_warps, d.num_stages,
                             d.fused_combine, d.max_registers, d.prefetch_table)
        if meta.slot_mapping.shape[0] == n * meta.max_query_len:  # every sequence has max_query_len tokens
            return PagedPlan(None, 0, None, n, meta.max_query_len, 1)
        dec = [i for i, ql in enumerate(meta.query_lens_cpu) if ql == 1]
        pre = [i for i, ql in enumerate(meta.query_lens_cpu) if ql != 1]
        dev = meta.seq_lens.device
        # Decode rows of a mixed step use one split: mixed steps carry a prefill, so the
        # GPU is busy anyway, and this keeps the step's plan simple.
        return PagedPlan(
            decode_ids=_ids_on(dec, dev) if dec else None,
            num_decode=len(dec),
            # None: every sequence prefills, and the launch serves sequences 0..n-1.
            prefill_ids=_ids_on(pre, dev) if dec else None,
            num_prefill=len(pre),
            max_prefill_query_len=max(meta.query_lens_cpu[i] for i in pre),
            num_splits=1,
        )

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        plan: PagedPlan,
        scale: float,
        sliding_window: int | None,
        logits_soft_cap: float | None = None,
        rope: PendingRope | None = None,
    ) -> torch.Tensor:  # [T, Hq, D]
        args = rope.kernel_args(q, k) if rope is not None else None
        if args is not None:  # one launch rotates q and k and writes the rotated K and V
            q = rope_store(q, k, v, kv_cache, meta.slot_mapping, args)
        else:
            if rope is not None:
                q, k = rope.apply(q, k)
            store_kv(k, v, kv_cache, meta.slot_mapping)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty((q.shape[0], self.num_heads, self.head_dim), dtype=q.dtype, device=q.device)
        # An FP8 pool has a kernel of its own (triton_fp8_attention.py); LOOM_FP8_KV_KERNEL=0
        # sends it to the generic kernel's FP8 path instead.
        attend = paged_attention_fp8 if kv_fp8.is_packed(kv_cache) and kernel_switches.fp8_kv_kernel else paged_attention
        if plan.num_decode:
            if attend is paged_attention_fp8:  # its own split cut; the plan's tile from its own table
                # Float32 activations (tests, reference runs) keep the launcher's warps: its IEEE
                # dots need four, a measured plan is for half-precision ones.
                f32 = q.dtype == torch.float32
                warps = None if f32 else plan.num_warps
                attend(q, kv_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                       num_seqs=plan.num_decode, seq_ids=plan.decode_ids, max_query_len=1,
                       num_splits=plan.num_splits, scale=scale, sliding_window=sliding_window,
                       logits_soft_cap=logits_soft_cap, block_n=plan.block_n, num_warps=warps,
                       num_stages=plan.num_stages, max_registers=None if f32 else plan.max_registers,
                       prefetch_table=plan.prefetch_table)
            else:
                fused = plan.fused_combine and plan.num_splits > 1
                paged_attention(q, kv_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                num_seqs=plan.num_decode, seq_ids=plan.decode_ids, max_query_len=1,
                                num_splits=plan.num_splits, scale=scale, sliding_window=sliding_window,
                                logits_soft_cap=logits_soft_cap, block_n=plan.block_n, num_warps=plan.num_warps,
                                num_stages=plan.num_stages, min_keys=plan.min_keys,
                                counters=counters(q.device) if fused else None)
        if plan.num_prefill:
            attend(q, kv_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                   num_seqs=plan.num_prefill, seq_ids=plan.prefill_ids,
                   max_query_len=plan.max_prefill_query_len, scale=scale,
                   sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
        return out
