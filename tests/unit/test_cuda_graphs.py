"""CUDA-graph runner logic that needs no GPU: size selection and when graphs are not used.

Capture and replay themselves are tested in tests/gpu/test_paged_attention.py.
"""

from __future__ import annotations

import torch
from torch import nn

from loom.engine.cuda_graphs import CudaGraphRunner, maybe_capture_cuda_graphs
from loom.layers.attention import AttentionBackend


def test_size_for_picks_next_captured_size() -> None:
    runner = CudaGraphRunner([8, 1, 2, 4, 4], block_size=16, device=torch.device("cpu"))
    assert runner.sizes == [1, 2, 4, 8]
    assert [runner.size_for(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]


def test_not_captured_on_cpu_or_without_sizes_or_capable_backend() -> None:
    backend = AttentionBackend(4, 2, 16, torch.float32, torch.device("cpu"))
    model = nn.Identity()
    assert maybe_capture_cuda_graphs((1, 2), model, backend, [], 16, 128, torch.device("cpu")) is None
    assert maybe_capture_cuda_graphs((), model, backend, [], 16, 128, torch.device("cuda")) is None
    # The base backend does not declare graph support: no capture is attempted.
    assert not AttentionBackend.supports_cuda_graphs
    assert maybe_capture_cuda_graphs((1, 2), model, backend, [], 16, 128, torch.device("cuda")) is None
