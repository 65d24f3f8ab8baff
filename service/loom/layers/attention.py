"""The attention layer models call, and the contract attention backends implement.

Models never see batch bookkeeping: a decoder layer calls ``self.attn(q, k, v)`` on the flat
token dimension. The model runner sets a :class:`ForwardContext` for the step (which tokens
belong to which sequence, where their K/V go in the paged pool, the block tables) and the
:class:`Attention` layer hands it to the chosen backend together with its layer's cache.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class AttentionMetadata:
    """Per-step layout of the flattened batch. ``B`` sequences, ``T`` new tokens in all.

    Sequence ``i`` contributes query tokens ``query_start_loc[i]:query_start_loc[i+1]``: the last
    ``query_lens[i]`` tokens of its ``seq_lens[i]`` tokens of context. Its K/V for positions
    ``< seq_lens[i] - query_lens[i]`` are already in the pool; the new ones are written to
    ``slot_mapping`` (slot = block_id * block_size + offset) before attention reads them.
    """

    query_start_loc: torch.Tensor  # [B + 1] int32, on device
    seq_lens: torch.Tensor  # [B] int32, on device
    slot_mapping: torch.Tensor  # [T] int64, on device
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, on device (padded with 0)
    # Host copies, so backends can plan without a device sync.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend:
    """What an attention backend plugin provides. One instance serves all layers of a model.

    ``kv_cache`` for a layer is a tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
    (K then V) allocated by the runner through :meth:`allocate_kv_cache`.
    """

    name: str = "abstract"
    # True when forward() on a pure-decode step is CUDA-graph capturable: no host syncs, no
    # tensors made from host data, launches shaped only by host values fixed at capture
    # (num_seqs, max_query_len, max_seq_len as an upper bound), device metadata read in place.
    supports_cuda_graphs: bool = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device

    def allocate_kv_cache(self, num_layers: int, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        """One cache tensor per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``."""
        shape = (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(num_layers)]

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write the new K/V into the pool at ``meta.slot_mapping``, then attend causally."""
        raise NotImplementedError


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Write new K/V ``[T, Hkv, D]`` into the pool at flat ``slots`` (block_id * block_size + offset)."""
    _, num_blocks, bs, hkv, d = kv_cache.shape
    kv_cache[0].view(num_blocks * bs, hkv, d).index_copy_(0, slots, k)
    kv_cache[1].view(num_blocks * bs, hkv, d).index_copy_(0, slots, v)


@dataclass
class ForwardContext:
    backend: AttentionBackend
    kv_caches: list[torch.Tensor]
    meta: AttentionMetadata


_context: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[None]:
    """Set the step's attention context for the duration of one model forward."""
    global _context
    previous, _context = _context, ctx
    try:
        yield
    finally:
        _context = previous


def get_forward_context() -> ForwardContext:
    if _context is None:
        raise RuntimeError("attention called outside a model runner step (no forward context set)")
    return _context


class Attention(nn.Module):
    """Paged causal self-attention over the step's flattened tokens (no parameters)."""

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float | None = None, sliding_window: int | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim**-0.5
        self.sliding_window = sliding_window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq*D], k/v: [T, Hkv*D] -> [T, Hq*D]."""
        ctx = get_forward_context()
        T = q.shape[0]
        out = ctx.backend.forward(
            q.view(T, self.num_heads, self.head_dim),
            k.view(T, self.num_kv_heads, self.head_dim),
            v.view(T, self.num_kv_heads, self.head_dim),
            ctx.kv_caches[self.layer_idx],
            ctx.meta,
            self.scale,
            self.sliding_window,
        )
        return out.reshape(T, self.num_heads * self.head_dim)
