"""CUDA graphs for steps of uniform query length: capture the model forward per shape, then replay.

A step of ``n`` sequences that each have ``q`` query tokens (``q = 1``: decode; ``q = k + 1``:
verification of ``k`` draft tokens) has ``n * q`` tokens. Replaying the graph captured for the
next size ``bs >= n`` and the same ``q`` turns the step's hundreds of kernel launches (and the
Python that issues them) into one graph launch. Graphs are keyed by ``(bs, q)``; the query
lengths are a small fixed set given at construction (``(1,)`` by default). An optional
``max_tokens`` leaves out the graphs of more than that many rows (``bs * q``): a draft model's
catch-up widths of up to 128 rows are captured at the small batch sizes only, where a step's
launches cost more than its math (``loom_plugins.speculative.draft_catch_up``).

What a graph reads has to live at fixed addresses. The runner owns the model's inputs,
``input_ids`` and ``positions`` ``[max_bs * max_q]``; the attention backend owns its metadata
buffers (``AttentionBackend.init_cuda_graph_state`` / ``capture_metadata`` /
``prepare_replay``, see ``loom/layers/attention_graph.py``), so this module never builds a
backend's metadata. Each graph's plan is what the backend's ``prepare`` returns for the capture
metadata: host values fixed at capture, device metadata read in place.

A query length the backend cannot capture (``AttentionBackend.can_capture``) gets no graphs:
such steps run eagerly. Padding rows ``n..bs-1`` keep stale but valid inputs (earlier tokens and
positions); the backend's padding writes and attends nothing, and their outputs are dropped.

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
from loom.lora.layers import LoraBatch, lora_batch

if TYPE_CHECKING:
    from .model_runner import StepInputs

log = structlog.get_logger(__name__)

# What is captured: the model's forward, input_ids [T], positions [T] -> hidden [T, H].
ModelForward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class CudaGraphRunner:
    """Captured graphs for a set of batch sizes times a set of query lengths, and the model
    inputs they read."""

    def __init__(self, sizes: Sequence[int], block_size: int, device: torch.device,
                 query_lens: Sequence[int] = (1,), lora: bool = False, max_tokens: int | None = None) -> None:
        if not sizes:
            raise ValueError("no CUDA graph batch sizes given")
        if not query_lens or min(query_lens) < 1:
            raise ValueError(f"CUDA graph query lengths must be >= 1, got {tuple(query_lens)}")
        self.sizes = sorted(set(sizes))
        self.query_lens = sorted(set(query_lens))
        self.max_tokens = max_tokens  # no graph of more rows (bs * q); None: every size at every q
        self.block_size = block_size
        self.device = device
        self.max_bs = self.sizes[-1]
        self.max_blocks_per_seq = 0
        self.backend: AttentionBackend[Any] | None = None
        self.captured_query_lens: list[int] = []  # those the backend could capture
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (bs, q) -> graph
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}  # (bs, q) -> [bs * q, hidden] in the pool
        self.num_replays = 0
        # LoRA: the rows' adapter slots, a fixed buffer the captured kernels read (0: base model)
        self.lora = lora
        self.lora_slots: torch.Tensor | None = None

    def capture(self, model: ModelForward, backend: AttentionBackend[Any], kv_caches: list[torch.Tensor],
                max_blocks_per_seq: int) -> None:
        """Warm up and capture ``model(input_ids, positions)`` for every (size, query length) the
        backend can capture, largest first (smaller graphs then reuse the pool memory)."""
        capturable = [q for q in self.query_lens if backend.can_capture(q) and self.sizes_for(q)]
        if not capturable:
            raise ValueError(f"attention backend {backend.name!r} cannot capture query lengths {self.query_lens}")
        skipped = [q for q in self.query_lens if not backend.can_capture(q)]
        if skipped:
            log.info("cuda graphs: these query lengths run eagerly, the attention backend cannot capture them",
                     attention_backend=backend.name, query_lens=skipped)
        self.backend = backend
        self.max_blocks_per_seq = max_blocks_per_seq
        dev = self.device
        rows = max(self.sizes_for(q)[-1] * q for q in capturable)  # the largest graph's tokens
        with torch.inference_mode():
            self.input_ids = torch.zeros(rows, dtype=torch.int64, device=dev)
            self.positions = torch.zeros(rows, dtype=torch.int64, device=dev)
            if self.lora:
                self.lora_slots = torch.zeros(rows, dtype=torch.int32, device=dev)
            pool = None
            for q in reversed(capturable):
                sizes = self.sizes_for(q)
                backend.init_cuda_graph_state(sizes[-1], max_blocks_per_seq, self.block_size, q)
                for bs in reversed(sizes):
                    meta = backend.capture_metadata(bs, q)
                    ctx = ForwardContext(backend, kv_caches, meta, backend.prepare(meta))

                    def forward(t: int = bs * q, ctx: ForwardContext = ctx) -> torch.Tensor:
                        # a fresh batch per forward: its rows' order by slot (LoraBatch.kernel_order) is
                        # sorted from the static slot buffer at the first adapted layer, inside the graph
                        slots = None if self.lora_slots is None else LoraBatch(self.lora_slots[:t], [], True)
                        with forward_context(ctx), lora_batch(slots):
                            out: torch.Tensor = model(self.input_ids[:t], self.positions[:t])  # [t, H]
                            return out

                    graph, out = _capture_one(forward, pool)
                    pool = graph.pool()
                    self.graphs[bs, q], self.outputs[bs, q] = graph, out
                self.captured_query_lens.append(q)
        self.captured_query_lens.sort()
        torch.cuda.synchronize(dev)

    def sizes_for(self, query_len: int) -> list[int]:
        """The batch sizes captured (or to capture) at ``query_len``: every size, or those within
        ``max_tokens`` rows."""
        if self.max_tokens is None:
            return self.sizes
        return [bs for bs in self.sizes if bs * query_len <= self.max_tokens]

    def size_for(self, n: int, query_len: int | None = None) -> int | None:
        """The smallest captured size holding ``n`` sequences (at ``query_len``), or None."""
        sizes = self.sizes if query_len is None else self.sizes_for(query_len)
        i = bisect.bisect_left(sizes, n)
        return sizes[i] if i < len(sizes) else None

    def graph_size(self, num_seqs: int, query_len: int) -> int | None:
        """The batch size of the captured graph that serves ``num_seqs`` sequences of
        ``query_len`` tokens each, or None (such a step runs eagerly)."""
        if query_len not in self.captured_query_lens:
            return None
        return self.size_for(num_seqs, query_len)

    def graph_key(self, meta: AttentionMetadata, num_tokens: int) -> tuple[int, int] | None:
        """``(bs, q)`` of the graph that serves this step, or None (run it eagerly): every
        sequence must have the same captured query length ``q`` and ``bs`` must hold them."""
        n, q = meta.num_seqs, meta.max_query_len
        # n sequences of at most q tokens each sum to n * q only when every one has exactly q
        if num_tokens != n * q:
            return None
        bs = self.graph_size(n, q)
        return None if bs is None else (bs, q)

    def try_run(self, inputs: StepInputs) -> torch.Tensor | None:
        """Replay the graph for this step when one fits; else None (run eagerly).

        Returns the final hidden states ``[n * q, hidden]`` (a view into the graph's output buffer).
        """
        if not self.graphs or self.backend is None:
            return None
        t = inputs.input_ids.shape[0]
        key = self.graph_key(inputs.meta, t)
        if key is None:
            return None
        bs, q = key
        self.input_ids[:t].copy_(inputs.input_ids)
        self.positions[:t].copy_(inputs.positions)
        if self.lora_slots is not None:
            self.lora_slots.zero_()  # padding rows and base rows: slot 0
            if inputs.lora is not None:
                self.lora_slots[:t].copy_(inputs.lora.token_slots)
        self.backend.prepare_replay(inputs.meta, bs, q)
        self.graphs[key].replay()
        self.num_replays += 1
        return self.outputs[key][:t]


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
    backend: AttentionBackend[Any],
    kv_caches: list[torch.Tensor],
    block_size: int,
    max_model_len: int,
    device: torch.device,
    max_batch_size: int | None = None,
    query_lens: Sequence[int] = (1,),
    lora: bool = False,
    max_tokens: int | None = None,
) -> CudaGraphRunner | None:
    """Capture graphs when they apply (CUDA device, sizes given, a backend that can capture one of
    ``query_lens``); None otherwise. A capture that fails is logged and leaves graphs off, not
    the engine down. ``max_tokens``: no graph of more rows than that (:class:`CudaGraphRunner`)."""
    wanted = sorted(set(sizes))
    if max_batch_size is not None:
        # Sizes past the first one that holds max_batch_size would never be replayed.
        cover = [s for s in wanted if s >= max_batch_size]
        wanted = [s for s in wanted if s < max_batch_size] + cover[:1]
    if not wanted or device.type != "cuda":
        return None
    if not any(backend.can_capture(q) for q in query_lens):
        log.info("cuda graphs off: the attention backend does not support them", attention_backend=backend.name,
                 query_lens=sorted(set(query_lens)))
        return None
    runner = CudaGraphRunner(wanted, block_size, device, query_lens, lora, max_tokens)
    max_blocks = -(-max_model_len // block_size)
    try:
        runner.capture(model, backend, kv_caches, max_blocks)
    except Exception as exc:  # a model op that cannot be captured must not stop the server
        log.warning("cuda graph capture failed; running steps eagerly", error=repr(exc))
        return None
    log.info("cuda graphs captured", sizes=runner.sizes, query_lens=runner.captured_query_lens,
             max_blocks_per_seq=max_blocks, max_tokens=max_tokens)
    return runner
