"""The ``flash`` attention backend: flash-attn 2's kernels over the paged KV pool (CUDA only).

* K/V writes: the paged backend's Triton ``store_kv`` (one launch for K and V; skips slot -1).
* pure decode: ``flash_attn_with_kvcache`` with ``block_table`` and ``cache_seqlens`` (the pool
  already holds the new token, so no ``k``/``v`` are passed for it to append);
* otherwise: ``flash_attn_varlen_func`` with ``block_table``; its causal mask is aligned to the
  end of each sequence when a query is shorter than its keys (flash-attn >= 2.1), which is our
  rule for a suffix on cached context.

Our pool per layer is ``[2, num_blocks, block_size, Hkv, D]``, so ``kv_cache[0]`` and
``kv_cache[1]`` are exactly the ``[num_blocks, page_block_size, Hkv, D]`` K and V caches
flash-attn's paged mode takes, without a copy. That mode needs the page size to be a multiple of
256, checked when the pool is allocated.

Soft-capped scores (Gemma 2): flash-attn's ``softcap`` argument (flash-attn >= 2.6), the same
``cap * tanh(score / cap)``, passed only when a layer caps (older releases lack the argument).

Sliding window: we attend keys ``p > q_pos - window``; flash-attn's ``window_size=(left, right)``
admits keys in ``[q_pos - left, q_pos + right]``, so ``left = window - 1`` and ``right = 0``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from loom.plugin_api import AttentionBackend, AttentionMetadata, write_kv

# flash-attn 2's paged KV (block_table) needs pages of a multiple of this many tokens.
FLASH_PAGE_MULTIPLE = 256


@dataclass(frozen=True)
class FlashPlan:
    """What every layer of a step shares."""

    cu_seqlens_k: torch.Tensor | None  # [B + 1] int32 cumulative key lengths; None for pure decode


def _flash_module() -> Any:
    import flash_attn

    return flash_attn


def _window(sliding_window: int | None) -> tuple[int, int]:
    return (-1, -1) if sliding_window is None else (sliding_window - 1, 0)


def _store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """The Triton store on CUDA; ``index_copy_`` elsewhere (CPU tests with a stand-in flash_attn)."""
    if kv_cache.is_cuda:
        from .triton_kernels import store_kv

        store_kv(k, v, kv_cache, slots)
        return
    write_kv(k, v, kv_cache, slots)


class FlashAttentionBackend(AttentionBackend[FlashPlan]):
    """flash-attn 2 (``flash_attn_varlen_func`` / ``flash_attn_with_kvcache``) with paged KV."""

    name = "flash"
    supports_logits_soft_cap = True
    # flash_attn_with_kvcache is capturable in principle, but this path has not been run on a GPU
    # here (no flash-attn wheel on the device machine), so graphs stay off until it is.
    supports_cuda_graphs = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, dtype, device)
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"flash-attn needs float16 or bfloat16, got {dtype} (use --dtype)")
        self._fa = _flash_module()

    def allocate_kv_cache(self, num_layers: int, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        if block_size % FLASH_PAGE_MULTIPLE != 0:
            raise ValueError(
                f"the flash attention backend needs --block-size to be a multiple of {FLASH_PAGE_MULTIPLE} "
                f"(flash-attn's paged KV cache), got {block_size}; set --block-size {FLASH_PAGE_MULTIPLE} "
                "or choose --attention-backend paged"
            )
        return super().allocate_kv_cache(num_layers, num_blocks, block_size)

    def prepare(self, meta: AttentionMetadata) -> FlashPlan:
        if meta.is_pure_decode:  # flash_attn_with_kvcache takes the lengths themselves
            return FlashPlan(None)
        cu = torch.zeros(meta.num_seqs + 1, dtype=torch.int32, device=meta.seq_lens.device)
        torch.cumsum(meta.seq_lens, dim=0, dtype=torch.int32, out=cu[1:])
        return FlashPlan(cu)

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        plan: FlashPlan,
        scale: float,
        sliding_window: int | None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:  # [T, Hq, D]
        _store_kv(k, v, kv_cache, meta.slot_mapping)
        extra = {} if logits_soft_cap is None else {"softcap": logits_soft_cap}
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, page, Hkv, D] each
        if meta.is_pure_decode:
            out = self._fa.flash_attn_with_kvcache(
                q.unsqueeze(1),  # [B, 1, Hq, D]
                k_cache,
                v_cache,
                cache_seqlens=meta.seq_lens,
                block_table=meta.block_tables,
                softmax_scale=scale,
                causal=True,
                window_size=_window(sliding_window),
                **extra,
            )  # [B, 1, Hq, D]
            return out.squeeze(1)
        return self._fa.flash_attn_varlen_func(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=meta.query_start_loc,
            cu_seqlens_k=plan.cu_seqlens_k,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            softmax_scale=scale,
            causal=True,
            window_size=_window(sliding_window),
            block_table=meta.block_tables,
            **extra,
        )  # [T, Hq, D]
