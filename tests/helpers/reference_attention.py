"""A slow, obviously-correct paged attention backend and a harness that drives a model with it.

Test-only: it gathers each sequence's whole context from the paged pool and attends in float32
with an explicit mask, so model tests do not depend on the production backends.
"""

from __future__ import annotations

from typing import Any

import torch

from loom.layers.attention import AttentionBackend, AttentionMetadata, ForwardContext, forward_context
from loom.model_loader.hf_config import model_dims


class ReferenceAttentionBackend(AttentionBackend[None]):
    name = "test-reference"
    supports_logits_soft_cap = True

    def prepare(self, meta: AttentionMetadata) -> None:
        return None  # plans nothing: forward reads the metadata directly

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        plan: None,
        scale: float,
        sliding_window: int | None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:  # [T, Hq, D]
        bs = meta.block_size
        key_pool = kv_cache[0].view(-1, self.num_kv_heads, self.head_dim)  # [slots, Hkv, D]
        value_pool = kv_cache[1].view(-1, self.num_kv_heads, self.head_dim)
        key_pool[meta.slot_mapping] = k.to(key_pool.dtype)
        value_pool[meta.slot_mapping] = v.to(value_pool.dtype)
        rep = self.num_heads // self.num_kv_heads
        out = torch.empty_like(q)
        starts = meta.query_start_loc.tolist()
        for i, (q_len, s_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
            kv_pos = torch.arange(s_len, device=q.device)  # [S]
            slots = meta.block_tables[i, kv_pos // bs].long() * bs + kv_pos % bs
            keys = key_pool[slots].float().repeat_interleave(rep, dim=1)  # [S, Hq, D]
            values = value_pool[slots].float().repeat_interleave(rep, dim=1)
            q_pos = torch.arange(s_len - q_len, s_len, device=q.device)  # [Q]
            allowed = kv_pos[None, :] <= q_pos[:, None]  # [Q, S]
            if sliding_window is not None:
                allowed &= kv_pos[None, :] > q_pos[:, None] - sliding_window
            qi = q[starts[i] : starts[i] + q_len].float()  # [Q, Hq, D]
            scores = torch.einsum("qhd,shd->hqs", qi, keys) * scale
            if logits_soft_cap is not None:
                scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
            probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
            out[starts[i] : starts[i] + q_len] = torch.einsum("hqs,shd->qhd", probs, values).to(q.dtype)
        return out


class ModelHarness:
    """Runs steps of a loaded model with a private KV pool; each sequence owns a fixed block range."""

    def __init__(self, model: Any, config: Any, *, block_size: int = 4, num_blocks: int = 64,
                 max_seqs: int = 4, backend_cls: type[AttentionBackend[Any]] = ReferenceAttentionBackend,
                 dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        dims = model_dims(config)
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        self.backend = backend_cls(dims.num_heads, dims.num_kv_heads, dims.head_dim, dtype, self.device)
        self.kv_caches = self.backend.allocate_kv_cache(dims.num_layers, num_blocks, block_size)
        per_seq = num_blocks // max_seqs
        self.block_tables = torch.arange(num_blocks, dtype=torch.int32, device=self.device).view(max_seqs, per_seq)

    def step(self, chunks: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """``(seq slot, new token ids, tokens already cached)`` per sequence -> logits ``[T, V]``."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        for seq, tokens, cached in chunks:
            for p in range(cached, cached + len(tokens)):
                positions.append(p)
                slots.append(int(self.block_tables[seq, p // self.block_size]) * self.block_size + p % self.block_size)
            ids.extend(tokens)
            starts.append(starts[-1] + len(tokens))
        query_lens = [len(t) for _, t, _ in chunks]
        seq_lens = [c + len(t) for _, t, c in chunks]
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            block_tables=self.block_tables[[seq for seq, _, _ in chunks]],
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=self.block_size,
        )
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        plan = self.backend.prepare(meta)
        with torch.no_grad(), forward_context(ForwardContext(self.backend, self.kv_caches, meta, plan)):
            hidden = self.model(input_ids, pos)  # [T, H]
            return self.model.compute_logits(hidden)  # [T, V]

    def prefill(self, token_ids: list[int], seq: int = 0) -> torch.Tensor:
        return self.step([(seq, token_ids, 0)])
