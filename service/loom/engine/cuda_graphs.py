"""CUDA graphs for decode steps: capture the model forward once per batch size, then replay.

A decode step of ``n`` sequences has ``n`` tokens. Replaying a captured graph of the next size
``bs >= n`` turns the step's hundreds of kernel launches (and the Python that issues them) into
one graph launch. What a graph reads has to live at fixed addresses, so the runner owns static
input buffers sized for the largest graph:

* ``input_ids``, ``positions``, ``slot_mapping``, ``seq_lens`` ``[max_bs]``;
* ``query_start_loc`` ``[max_bs + 1]`` = ``0, 1, ..., max_bs`` (one token per sequence, fixed);
* ``block_tables`` ``[max_bs, max_blocks_per_seq]``, the width fixed by the longest sequence the
  engine admits.

Each graph's :class:`AttentionMetadata` is built from slices of these buffers at capture time,
so the attention backend's kernels read whatever the step copied in. Host-side fields of that
metadata are fixed at capture: ``max_seq_len`` is the upper bound ``max_blocks_per_seq *
block_size``, and a backend must not depend on ``query_lens_cpu``/``seq_lens_cpu`` for decode
(:attr:`AttentionBackend.supports_cuda_graphs` promises that).

Padding rows ``n..bs-1`` get ``slot_mapping = -1`` (the backend skips their K/V write, so the
pool is never touched: no dummy block is needed) and ``seq_lens = 0`` (they attend nothing and
read no block table entry). Their other inputs are stale but valid (earlier tokens, positions),
and their outputs are dropped. Block-table columns past the step's width keep stale ids; the
kernels only read the ``ceil(seq_len / block_size)`` columns a sequence has.

The output of a replay lives in the graph's memory pool and is overwritten by the next replay:
the caller must consume it (logits) before the next step.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import structlog
import torch

from loom.layers.attention import AttentionBackend, AttentionMetadata, ForwardContext, forward_context

if TYPE_CHECKING:
    from .model_runner import StepInputs

log = structlog.get_logger(__name__)

# What is captured: the model's forward, input_ids [T], positions [T] -> hidden [T, H].
ModelForward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class CudaGraphRunner:
    """Captured decode graphs for a set of batch sizes, and the static buffers they read."""

    def __init__(self, sizes: Sequence[int], block_size: int, device: torch.device) -> None:
        if not sizes:
            raise ValueError("no CUDA graph batch sizes given")
        self.sizes = sorted(set(sizes))
        self.block_size = block_size
        self.device = device
        self.max_bs = self.sizes[-1]
        self.max_blocks_per_seq = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bs -> [bs, hidden] in the graph pool
        self.metas: dict[int, AttentionMetadata] = {}
        self.num_replays = 0

    def capture(self, model: ModelForward, backend: AttentionBackend, kv_caches: list[torch.Tensor],
                max_blocks_per_seq: int) -> None:
        """Warm up and capture ``model(input_ids, positions)`` for every size, largest first (the
        smaller graphs then reuse the largest one's pool memory)."""
        if not backend.supports_cuda_graphs:
            raise ValueError(f"attention backend {backend.name!r} does not support CUDA graphs")
        self.max_blocks_per_seq = max_blocks_per_seq
        dev, mb = self.device, self.max_bs
        with torch.inference_mode():
            self.input_ids = torch.zeros(mb, dtype=torch.int64, device=dev)
            self.positions = torch.zeros(mb, dtype=torch.int64, device=dev)
            self.slot_mapping = torch.full((mb,), -1, dtype=torch.int64, device=dev)
            self.seq_lens = torch.zeros(mb, dtype=torch.int32, device=dev)
            self.query_start_loc = torch.arange(mb + 1, dtype=torch.int32, device=dev)
            self.block_tables = torch.zeros((mb, max_blocks_per_seq), dtype=torch.int32, device=dev)
            pool = None
            for bs in reversed(self.sizes):
                meta = self._static_meta(bs)
                ctx = ForwardContext(backend, kv_caches, meta)

                def forward(bs: int = bs, ctx: ForwardContext = ctx) -> torch.Tensor:
                    with forward_context(ctx):
                        out: torch.Tensor = model(self.input_ids[:bs], self.positions[:bs])  # [bs, H]
                        return out

                graph, out = _capture_one(forward, pool)
                pool = graph.pool()
                self.graphs[bs], self.outputs[bs], self.metas[bs] = graph, out, meta
        torch.cuda.synchronize(dev)

    def _static_meta(self, bs: int) -> AttentionMetadata:
        max_len = self.max_blocks_per_seq * self.block_size
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            slot_mapping=self.slot_mapping[:bs],
            block_tables=self.block_tables[:bs],
            query_lens_cpu=[1] * bs,
            seq_lens_cpu=[max_len] * bs,  # an upper bound; not read by a graph-capable decode path
            max_query_len=1,
            max_seq_len=max_len,  # the upper bound: picks the backend's split count
            block_size=self.block_size,
        )

    def size_for(self, n: int) -> int | None:
        """The smallest captured size holding ``n`` sequences, or None."""
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else None

    def try_run(self, inputs: StepInputs) -> torch.Tensor | None:
        """Replay the graph for this step when it is a pure decode that fits; else None (run eagerly).

        Returns the final hidden states ``[n, hidden]`` (a view into the graph's output buffer).
        """
        meta = inputs.meta
        if not self.graphs or not meta.is_pure_decode:
            return None
        n = meta.num_seqs
        bs = self.size_for(n)
        # The runner pads tables to a multiple of 16 columns; columns past the captured width are
        # padding (no sequence is longer than max_model_len, which the capture covers).
        width = min(meta.block_tables.shape[1], self.max_blocks_per_seq)
        if bs is None or inputs.input_ids.shape[0] != n or width > self.max_blocks_per_seq:
            return None
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables[:, :width])
        if bs > n:  # a larger step may have left real rows here
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[n:bs].zero_()
        self.graphs[bs].replay()
        self.num_replays += 1
        return self.outputs[bs][:n]


def _capture_one(forward: Callable[[], torch.Tensor],
                 pool: Any) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    # Warm up on a side stream first: Triton compiles and loads its kernels, cuBLAS picks its
    # algorithms and workspaces, none of which may happen during capture.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph, out


def maybe_capture_cuda_graphs(
    sizes: Sequence[int],
    model: ModelForward,
    backend: AttentionBackend,
    kv_caches: list[torch.Tensor],
    block_size: int,
    max_model_len: int,
    device: torch.device,
    max_batch_size: int | None = None,
) -> CudaGraphRunner | None:
    """Capture decode graphs when they apply (CUDA device, sizes given, a capable backend);
    None otherwise. A capture that fails is logged and leaves graphs off, not the engine down."""
    wanted = sorted(set(sizes))
    if max_batch_size is not None:
        # Sizes past the first one that holds max_batch_size would never be replayed.
        cover = [s for s in wanted if s >= max_batch_size]
        wanted = [s for s in wanted if s < max_batch_size] + cover[:1]
    if not wanted or device.type != "cuda":
        return None
    if not backend.supports_cuda_graphs:
        log.info("cuda graphs off: the attention backend does not support them", attention_backend=backend.name)
        return None
    runner = CudaGraphRunner(wanted, block_size, device)
    max_blocks = -(-max_model_len // block_size)
    try:
        runner.capture(model, backend, kv_caches, max_blocks)
    except Exception as exc:  # a model op that cannot be captured must not stop the server
        log.warning("cuda graph capture failed; running decode eagerly", error=repr(exc))
        return None
    log.info("cuda graphs captured", sizes=runner.sizes, max_blocks_per_seq=max_blocks)
    return runner
