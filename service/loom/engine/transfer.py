"""Host -> device copies that do not stall the host.

``torch.tensor(data, device="cuda")`` copies from pageable memory, which waits for all work
queued on the device: a step that built its sampling tensors after launching the forward would
sit idle until the forward ended. Staging through pinned memory makes the copy asynchronous, so
the host prepares the next pieces while the GPU runs. (PyTorch caches pinned blocks and only
reuses one after the copy that used it has finished.)
"""

from __future__ import annotations

from typing import Any

import torch


def to_device(data: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``data`` (nested lists of numbers) on ``device``, copied without a stall."""
    return host_to_device(torch.tensor(data, dtype=dtype), device)


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
