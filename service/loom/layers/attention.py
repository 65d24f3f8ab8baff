"""The attention layer models call, and the contract attention backends implement.

Models never see batch bookkeeping: a decoder layer calls ``self.attn(q, k, v)`` on the flat
token dimension. Once per step the model runner describes the batch in an
:class:`AttentionMetadata` (which tokens belong to which sequence, where their K/V go in the
paged pool, the block tables), asks the backend to :meth:`~AttentionBackend.prepare` its plan
for the step, and sets a :class:`ForwardContext` holding both; each :class:`Attention` layer
hands them to the backend together with its layer's cache.

CUDA graphs: the graph runner never builds a backend's metadata. It asks the backend for static
buffers (:meth:`~AttentionBackend.init_cuda_graph_state`), for metadata over them to capture
with (:meth:`~AttentionBackend.capture_metadata`), and before each replay to copy the step's
metadata into them (:meth:`~AttentionBackend.prepare_replay`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
from torch import nn

if TYPE_CHECKING:
    from .attention_graph import StaticAttentionBuffers
    from .rotary import PendingRope

# What a backend's prepare() returns and its forward() reads: the backend's own plan type.
PlanT = TypeVar("PlanT")


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step layout of the flattened batch. ``B`` sequences, ``T`` new tokens in all.

    Sequence ``i`` contributes query tokens ``query_start_loc[i]:query_start_loc[i+1]``: the last
    ``query_lens[i]`` tokens of its ``seq_lens[i]`` tokens of context. Its K/V for positions
    ``< seq_lens[i] - query_lens[i]`` are already in the pool; the new ones are written to
    ``slot_mapping`` (slot = block_id * block_size + offset) before attention reads them.

    Slotted, so it takes no attributes beyond these: a backend keeps what it derives from the
    step in the plan its :meth:`AttentionBackend.prepare` returns, never on the metadata.
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


class AttentionBackend(Generic[PlanT]):
    """What an attention backend plugin provides. One instance serves all layers of a model.

    ``kv_cache`` for a layer is a tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
    (K then V) allocated by the runner through :meth:`allocate_kv_cache`.

    Per step: :meth:`prepare` once (the runner), then :meth:`forward` once per layer with the
    plan it returned. For CUDA graphs, per query length ``q`` the graph runner captures:
    :meth:`init_cuda_graph_state` once, then for each batch size :meth:`capture_metadata` and
    :meth:`prepare` on that metadata (the plan baked into the graph), and before each replay
    :meth:`prepare_replay`. The defaults keep the metadata's own tensors in static buffers; a
    backend whose plan holds device state derived from the metadata overrides
    :meth:`prepare_replay` to refresh it.
    """

    name: str = "abstract"
    # True when forward() on a pure-decode step is CUDA-graph capturable: no host syncs, no
    # tensors made from host data, launches shaped only by host values fixed at capture
    # (num_seqs, max_query_len, max_seq_len as an upper bound), device metadata read in place.
    supports_cuda_graphs: bool = False
    # The same promise for steps whose every sequence has one query length q > 1 (verification
    # of q - 1 draft tokens on cached context): prepare() and forward() read no per-sequence
    # host list (query_lens_cpu, seq_lens_cpu hold capture-time placeholders in a graph).
    supports_cuda_graphs_multi_token: bool = False
    # True when forward() takes ``logits_soft_cap`` (Gemma 2): scores become
    # ``cap * tanh(scale * q.k / cap)`` before the mask and softmax. A model whose layers cap
    # their scores refuses a backend without it (see Attention.forward).
    supports_logits_soft_cap: bool = False
    # True when forward() reads and writes the packed FP8 pool of ``loom.layers.kv_fp8``
    # (``--kv-cache-dtype fp8``): e4m3 codes and a float32 scale per (token, KV head) row.
    supports_fp8_kv_cache: bool = False
    # True when forward() takes ``rope`` (a ``loom.layers.rotary.PendingRope``): q and k then come
    # unrotated (and, for Qwen3 / Gemma 3, unnormalised), and the backend applies the rope, e.g.
    # in the kernel that writes K/V into its pool (``rope.kernel_args``) or by ``rope.apply``
    # first. Without it the Attention layer applies the rope before calling forward().
    supports_rope_store: bool = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self._graph_buffers: dict[int, StaticAttentionBuffers] = {}  # query_len -> buffers
        self.fp8_kv_cache = False  # set by use_fp8_kv_cache(), before the pool is allocated

    def use_fp8_kv_cache(self) -> None:
        """Allocate (and read) the packed FP8 pool of ``loom.layers.kv_fp8`` from now on."""
        from . import kv_fp8

        if not self.supports_fp8_kv_cache:
            raise ValueError(f"the {self.name!r} attention backend cannot read an FP8 KV cache")
        kv_fp8.packed_row_bytes(self.head_dim)  # refuses a head_dim the format cannot align
        self.fp8_kv_cache = True

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """Bytes one token's K and V take in one layer's pool."""
        from . import kv_fp8

        if self.fp8_kv_cache:
            return 2 * self.num_kv_heads * kv_fp8.packed_row_bytes(self.head_dim)
        return 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def allocate_kv_cache(self, num_layers: int, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        """One cache tensor per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` in the
        model's dtype, or the packed FP8 pool ``[2, num_blocks, block_size, num_kv_heads, head_dim + 4]``
        uint8 (``loom.layers.kv_fp8``)."""
        if self.fp8_kv_cache:
            from . import kv_fp8

            return [kv_fp8.allocate(num_blocks, block_size, self.num_kv_heads, self.head_dim, self.device)
                    for _ in range(num_layers)]
        shape = (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(num_layers)]

    def prepare(self, meta: AttentionMetadata) -> PlanT:
        """The step's plan (from host-side fields; no device sync), built once per step and
        read by every layer's :meth:`forward`."""
        raise NotImplementedError(f"attention backend {self.name!r} does not implement prepare()")

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        plan: PlanT,  # what prepare(meta) returned
        scale: float,
        sliding_window: int | None,
        logits_soft_cap: float | None = None,  # passed only when set, and only if supported
        # (and ``rope=``, a PendingRope, only to a backend that sets supports_rope_store)
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write the new K/V into the pool at ``meta.slot_mapping``, then attend causally: query
        ``i`` of a sequence of ``L`` tokens (position ``p``) sees keys ``p - window < key <= p``."""
        raise NotImplementedError

    # -- CUDA graphs ------------------------------------------------------------------------------

    def can_capture(self, query_len: int) -> bool:
        """Whether a step whose every sequence has ``query_len`` tokens can run in a CUDA graph."""
        return self.supports_cuda_graphs if query_len == 1 else self.supports_cuda_graphs_multi_token

    def init_cuda_graph_state(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int,
                              query_len: int) -> None:
        """Allocate the static buffers graphs of ``query_len`` tokens per sequence read, for up
        to ``max_num_seqs`` sequences of up to ``max_blocks_per_seq`` blocks."""
        from .attention_graph import StaticAttentionBuffers

        if not self.can_capture(query_len):
            raise ValueError(f"attention backend {self.name!r} cannot capture steps of query length {query_len}")
        self._graph_buffers[query_len] = StaticAttentionBuffers(
            max_num_seqs, max_blocks_per_seq, block_size, query_len, self.device)

    def capture_metadata(self, num_seqs: int, query_len: int) -> AttentionMetadata:
        """Metadata over the static buffers for a graph of ``num_seqs`` sequences."""
        return self._graph_buffers[query_len].metadata(num_seqs)

    def prepare_replay(self, step_meta: AttentionMetadata, num_seqs: int, query_len: int) -> None:
        """Copy the step's metadata into the static buffers of the ``num_seqs`` graph (rows past
        the step's sequences become padding that writes and attends nothing)."""
        self._graph_buffers[query_len].copy_step(step_meta, num_seqs)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Write new K/V ``[T, Hkv, D]`` into the pool at flat ``slots`` (block_id * block_size + offset)."""
    _, num_blocks, bs, hkv, d = kv_cache.shape
    kv_cache[0].view(num_blocks * bs, hkv, d).index_copy_(0, slots, k)
    kv_cache[1].view(num_blocks * bs, hkv, d).index_copy_(0, slots, v)


@dataclass
class ForwardContext:
    """What the attention layers read during one model forward."""

    backend: AttentionBackend[Any]
    kv_caches: list[torch.Tensor]
    meta: AttentionMetadata
    plan: Any  # backend.prepare(meta): the backend's own plan type


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
    """Paged causal self-attention over the step's flattened tokens (no parameters).

    ``sliding_window``: this layer's window (None: the whole context); ``logits_soft_cap``:
    Gemma 2's ``cap * tanh(score / cap)`` on the scaled scores (None: no cap).
    """

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float | None = None, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim**-0.5
        self.sliding_window = sliding_window
        if logits_soft_cap is not None and logits_soft_cap <= 0:
            raise ValueError(f"logits_soft_cap must be positive, got {logits_soft_cap}")
        self.logits_soft_cap = logits_soft_cap
        # Only a capped layer passes the argument: backends written before it keep working.
        self._extra: dict[str, float] = {} if logits_soft_cap is None else {"logits_soft_cap": logits_soft_cap}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                rope: PendingRope | None = None) -> torch.Tensor:
        """q: [T, Hq*D], k/v: [T, Hkv*D] -> [T, Hq*D]. ``rope``: the layer's RoPE, not yet
        applied to q and k; the backend applies it where it can fuse it with its K/V write, else
        it is applied here first."""
        ctx = get_forward_context()
        T = q.shape[0]
        if self._extra and not ctx.backend.supports_logits_soft_cap:
            raise ValueError(f"this model caps attention scores (Gemma 2's attn_logit_softcapping), which the "
                             f"{ctx.backend.name!r} attention backend does not implement; choose torch or paged")
        q3 = q.view(T, self.num_heads, self.head_dim)
        k3 = k.view(T, self.num_kv_heads, self.head_dim)
        extra: dict[str, Any] = self._extra
        if rope is not None:
            if ctx.backend.supports_rope_store:
                extra = {**extra, "rope": rope}
            else:
                q3, k3 = rope.apply(q3, k3)
        out = ctx.backend.forward(
            q3,
            k3,
            v.view(T, self.num_kv_heads, self.head_dim),
            ctx.kv_caches[self.layer_idx],
            ctx.meta,
            ctx.plan,
            self.scale,
            self.sliding_window,
            **extra,
        )
        return out.reshape(T, self.num_heads * self.head_dim)
