"""Random paged-attention steps for backend tests: a pool with stale data, shuffled block tables.

``make_step`` builds the inputs of one :meth:`AttentionBackend.forward` call for sequences given
as ``(context_len, query_len)``: the cached context's K/V already sit in the pool at the blocks
of a random block table, the new tokens' K/V are the inputs, and every slot the step does not
own holds finite garbage (so a kernel that reads outside its sequence shows up).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from loom.layers.attention import AttentionMetadata


@dataclass
class PagedStep:
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor  # [T, Hkv, D]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata


def make_step(
    seqs: list[tuple[int, int]],  # (context_len, query_len) per sequence, in batch order
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    spare_blocks: int = 5,
    extra_table_columns: int = 2,
) -> PagedStep:
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    seq_lens = [c + q for c, q in seqs]
    query_lens = [q for _, q in seqs]
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + spare_blocks
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    free = list(range(num_blocks))
    rng.shuffle(free)
    width = max(need) + extra_table_columns
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    slots: list[int] = []
    for i, ((ctx, _), sl) in enumerate(zip(seqs, seq_lens, strict=True)):
        own = [free.pop() for _ in range(need[i])]
        tables[i, : len(own)] = torch.tensor(own, dtype=torch.int32)
        slots.extend(own[p // block_size] * block_size + p % block_size for p in range(ctx, sl))
    T = sum(query_lens)
    q = torch.randn(T, num_heads, head_dim, generator=gen)
    k = torch.randn(T, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(T, num_kv_heads, head_dim, generator=gen)
    loc = [0]
    for ql in query_lens:
        loc.append(loc[-1] + ql)
    dev = torch.device(device)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(loc, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        block_tables=tables.to(dev),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )
    return PagedStep(q.to(dev, dtype), k.to(dev, dtype), v.to(dev, dtype), kv_cache.to(dev, dtype), meta)
