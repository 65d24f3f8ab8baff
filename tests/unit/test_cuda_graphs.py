"""CUDA-graph runner logic that needs no GPU: size and query-length selection, when graphs are
not used, and the static attention metadata built through the backend's hooks.

Capture and replay on a GPU are tested in tests/gpu/test_paged_attention.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers.reference_attention import ReferenceAttentionBackend
from torch import nn

from loom.layers.attention import AttentionBackend, AttentionMetadata, get_forward_context
from loom.worker.cuda_graphs import CudaGraphRunner, maybe_capture_cuda_graphs
from loom.worker.model_runner import StepInputs


def test_size_for_picks_next_captured_size() -> None:
    runner = CudaGraphRunner([8, 1, 2, 4, 4], block_size=16, device=torch.device("cpu"))
    assert runner.sizes == [1, 2, 4, 8]
    assert [runner.size_for(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]


def test_max_tokens_leaves_out_the_graphs_of_more_rows() -> None:
    """A draft model's catch-up widths are captured at the batch sizes within its row limit."""
    runner = CudaGraphRunner([1, 2, 4, 8], block_size=16, device=torch.device("cpu"), query_lens=(1, 2, 16, 128),
                             max_tokens=512)
    assert runner.sizes_for(1) == runner.sizes_for(2) == runner.sizes_for(16) == [1, 2, 4, 8]
    assert runner.sizes_for(128) == [1, 2, 4]
    runner.captured_query_lens = [1, 2, 16, 128]
    assert [runner.graph_size(n, 128) for n in (1, 3, 4, 5)] == [1, 4, 4, None]
    assert runner.graph_size(5, 16) == 8 and runner.graph_size(3, 32) is None  # 32: not captured
    assert runner.size_for(5) == 8  # without a query length: every size
    unlimited = CudaGraphRunner([1, 2, 4, 8], block_size=16, device=torch.device("cpu"), query_lens=(1, 128))
    assert unlimited.sizes_for(128) == [1, 2, 4, 8]


def test_not_captured_on_cpu_or_without_sizes_or_capable_backend() -> None:
    backend = AttentionBackend(4, 2, 16, torch.float32, torch.device("cpu"))
    model = nn.Identity()
    assert maybe_capture_cuda_graphs((1, 2), model, backend, [], 16, 128, torch.device("cpu")) is None
    assert maybe_capture_cuda_graphs((), model, backend, [], 16, 128, torch.device("cuda")) is None
    # The base backend does not declare graph support: no capture is attempted.
    assert not AttentionBackend.supports_cuda_graphs
    assert maybe_capture_cuda_graphs((1, 2), model, backend, [], 16, 128, torch.device("cuda")) is None
    assert maybe_capture_cuda_graphs((1, 2), model, backend, [], 16, 128, torch.device("cuda"),
                                     query_lens=(1, 3)) is None


# ------------------------------------------------------------------------------------------------
# Static metadata through the backend's hooks (the parts that need no GPU)
# ------------------------------------------------------------------------------------------------


class CapturableBackend(ReferenceAttentionBackend):
    """The test reference with graph support declared: only the hooks are exercised here."""

    name = "capturable"
    supports_cuda_graphs = True
    supports_cuda_graphs_multi_token = True


def _backend(multi_token: bool = True) -> CapturableBackend:
    backend = CapturableBackend(4, 2, 16, torch.float32, torch.device("cpu"))
    backend.supports_cuda_graphs_multi_token = multi_token
    return backend


def _step(contexts: list[int], q: int, width: int = 3, page: int = 4) -> AttentionMetadata:
    """A step of ``len(contexts)`` sequences with ``q`` new tokens each; sequence i owns blocks
    10 * (i + 1) + column."""
    n = len(contexts)
    tables = torch.tensor([[10 * (i + 1) + c for c in range(width)] for i in range(n)], dtype=torch.int32)
    slots = [int(tables[i, p // page]) * page + p % page for i, c in enumerate(contexts) for p in range(c, c + q)]
    lens = [c + q for c in contexts]
    return AttentionMetadata(
        query_start_loc=torch.arange(0, (n + 1) * q, q, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=tables, query_lens_cpu=[q] * n, seq_lens_cpu=lens, max_query_len=q,
        max_seq_len=max(lens), block_size=page)


@pytest.mark.parametrize("q", [1, 3])
def test_capture_metadata_views_static_buffers(q: int) -> None:
    backend = _backend()
    backend.init_cuda_graph_state(8, 5, 4, q)
    meta = backend.capture_metadata(4, q)
    assert meta.query_start_loc.tolist() == [0, q, 2 * q, 3 * q, 4 * q]
    assert meta.slot_mapping.tolist() == [-1] * (4 * q)  # padding until a step is copied in
    assert meta.seq_lens.tolist() == [0] * 4 and meta.block_tables.shape == (4, 5)
    assert meta.query_lens_cpu == [q] * 4 and meta.max_query_len == q
    assert meta.max_seq_len == 20 and meta.seq_lens_cpu == [20] * 4  # the bound: 5 blocks of 4
    # Every graph of this query length reads the same addresses: smaller ones are prefixes.
    small = backend.capture_metadata(2, q)
    for name in ("query_start_loc", "seq_lens", "slot_mapping", "block_tables"):
        assert getattr(small, name).data_ptr() == getattr(meta, name).data_ptr()
    assert small.slot_mapping.shape == (2 * q,) and small.query_start_loc.tolist() == [0, q, 2 * q]
    with pytest.raises(ValueError, match="outside"):
        backend.capture_metadata(9, q)


@pytest.mark.parametrize("q", [1, 3])
def test_prepare_replay_copies_the_step_and_pads(q: int) -> None:
    backend = _backend()
    backend.init_cuda_graph_state(8, 5, 4, q)
    meta = backend.capture_metadata(4, q)
    big = _step([2, 5, 0], q)
    backend.prepare_replay(big, 4, q)
    assert meta.slot_mapping[: 3 * q].tolist() == big.slot_mapping.tolist()
    assert meta.slot_mapping[3 * q :].tolist() == [-1] * q
    assert meta.seq_lens.tolist() == [2 + q, 5 + q, q, 0]
    assert meta.block_tables[:3, :3].tolist() == big.block_tables.tolist()
    # A smaller step after it: the rows it leaves become padding again (slot -1, length 0).
    small = _step([5], q, width=2)
    backend.prepare_replay(small, 4, q)
    assert meta.slot_mapping.tolist() == small.slot_mapping.tolist() + [-1] * (3 * q)
    assert meta.seq_lens.tolist() == [5 + q, 0, 0, 0]
    assert meta.block_tables[0, :2].tolist() == [10, 11]
    assert meta.query_start_loc.tolist() == [0, q, 2 * q, 3 * q, 4 * q]  # never rewritten
    # A step whose sequences do not all have q tokens does not fit these buffers.
    with pytest.raises(ValueError, match="does not fit"):
        backend.prepare_replay(_step([1, 2], q + 1), 4, q)


def test_graph_key_needs_a_captured_query_length_for_every_sequence() -> None:
    runner = CudaGraphRunner([1, 2, 4], block_size=4, device=torch.device("cpu"), query_lens=(1, 3))
    runner.captured_query_lens = [1, 3]
    assert runner.graph_key(_step([3, 4, 5], 1), 3) == (4, 1)
    assert runner.graph_key(_step([3, 4], 3), 6) == (2, 3)
    assert runner.graph_key(_step([3, 4], 2), 4) is None  # no graphs for q = 2
    mixed = _step([3, 4], 3)  # max_query_len 3, but 4 tokens: one sequence has 1
    assert runner.graph_key(mixed, 4) is None
    assert runner.graph_key(_step([1] * 5, 3), 15) is None  # more sequences than the largest graph
    runner.captured_query_lens = [1]  # what a backend without multi-token capture leaves
    assert runner.graph_key(_step([3, 4], 3), 6) is None
    with pytest.raises(ValueError, match=">= 1"):
        CudaGraphRunner([1], block_size=4, device=torch.device("cpu"), query_lens=(0,))


class _ReplayByRerun:
    """Stands in for a CUDA graph on the CPU: replay runs the captured closure again."""

    def __init__(self, forward: Callable[[], torch.Tensor], out: torch.Tensor) -> None:
        self.forward, self.out = forward, out

    def pool(self) -> None:
        return None

    def replay(self) -> None:
        self.out.copy_(self.forward())


@pytest.mark.parametrize("multi_token", [True, False])
def test_capture_and_replay_go_through_the_backend_hooks(multi_token: bool,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import loom.worker.cuda_graphs as cg

    def fake_capture(forward: Callable[[], torch.Tensor], pool: Any) -> tuple[Any, torch.Tensor]:
        out = forward().clone()
        return _ReplayByRerun(forward, out), out

    monkeypatch.setattr(cg, "_capture_one", fake_capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    backend = _backend(multi_token)
    calls: list[tuple[Any, ...]] = []
    for hook in ("init_cuda_graph_state", "capture_metadata", "prepare", "prepare_replay"):
        original = getattr(backend, hook)

        def record(*args: Any, _hook: str = hook, _original: Any = original) -> Any:
            calls.append((_hook, *args))
            return _original(*args)

        monkeypatch.setattr(backend, hook, record)

    def model(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [T] -> [T, 2]
        meta = get_forward_context().meta  # what the graph reads: the backend's static metadata
        owner = torch.repeat_interleave(meta.seq_lens, torch.diff(meta.query_start_loc))  # [T]
        return torch.stack([input_ids * 10 + positions, owner.to(input_ids.dtype)], dim=1)

    runner = CudaGraphRunner([1, 2, 4], block_size=4, device=torch.device("cpu"), query_lens=(1, 3))
    runner.capture(model, backend, [], max_blocks_per_seq=5)
    expected_lens = [1, 3] if multi_token else [1]
    assert runner.captured_query_lens == expected_lens
    assert sorted(runner.graphs) == sorted((bs, q) for q in expected_lens for bs in (1, 2, 4))
    inits = [c for c in calls if c[0] == "init_cuda_graph_state"]
    assert sorted(c[4] for c in inits) == expected_lens and all(c[1:4] == (4, 5, 4) for c in inits)
    # The plan of each graph is prepared once, on its capture metadata.
    captured = [c for c in calls if c[0] == "capture_metadata"]
    assert len([c for c in calls if c[0] == "prepare"]) == len(captured) == len(runner.graphs)
    calls.clear()

    step = _step([2, 6, 1], 3)
    ids = torch.arange(100, 109)
    pos = torch.tensor([p for c in (2, 6, 1) for p in range(c, c + 3)])
    with torch.inference_mode():  # as ModelRunner.launch runs it
        hidden = runner.try_run(StepInputs(ids, pos, step))
    if not multi_token:
        assert hidden is None and calls == []  # run eagerly
        return
    assert hidden is not None and runner.num_replays == 1
    assert [c[0] for c in calls] == ["prepare_replay"] and calls[0][1] is step and calls[0][2:] == (4, 3)
    assert hidden[:, 0].tolist() == (ids * 10 + pos).tolist()
    assert hidden[:, 1].tolist() == [5] * 3 + [9] * 3 + [4] * 3  # each row saw its sequence's length
    with torch.inference_mode():
        decode = runner.try_run(StepInputs(torch.tensor([7]), torch.tensor([4]), _step([4], 1)))
    assert decode is not None and decode.tolist() == [[74, 5]]


def test_capture_within_max_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each query length is captured at the sizes within ``max_tokens`` rows, its static buffers
    sized for its largest graph; a step past them runs eagerly."""
    import loom.worker.cuda_graphs as cg

    def fake_capture(forward: Callable[[], torch.Tensor], pool: Any) -> tuple[Any, torch.Tensor]:
        out = forward().clone()
        return _ReplayByRerun(forward, out), out

    monkeypatch.setattr(cg, "_capture_one", fake_capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    backend = _backend()
    inits: list[tuple[int, int]] = []
    original = backend.init_cuda_graph_state

    def record(max_num_seqs: int, max_blocks: int, block_size: int, q: int) -> None:
        inits.append((q, max_num_seqs))
        original(max_num_seqs, max_blocks, block_size, q)

    monkeypatch.setattr(backend, "init_cuda_graph_state", record)

    def model(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [T] -> [T, 1]
        return (input_ids * 10 + positions)[:, None]

    runner = CudaGraphRunner([1, 2, 4], block_size=4, device=torch.device("cpu"), query_lens=(1, 3, 8), max_tokens=12)
    runner.capture(model, backend, [], max_blocks_per_seq=5)
    assert sorted(runner.graphs) == [(1, 1), (1, 3), (1, 8), (2, 1), (2, 3), (4, 1), (4, 3)]
    assert sorted(inits) == [(1, 4), (3, 4), (8, 1)]
    assert runner.input_ids.shape == (12,)
    with torch.inference_mode():
        one = runner.try_run(StepInputs(torch.arange(8), torch.arange(2, 10), _step([2], 8, width=4)))
        two = runner.try_run(StepInputs(torch.arange(16), torch.arange(16), _step([0, 8], 8, width=4)))
    assert one is not None and one[:, 0].tolist() == [i * 10 + i + 2 for i in range(8)]
    assert two is None and runner.num_replays == 1
