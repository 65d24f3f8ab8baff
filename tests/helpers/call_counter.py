"""Counting the calls of a module-level function a test wants to see taken (or not): the function
replaced, for the test's duration, by a wrapper that counts and calls through."""

from __future__ import annotations

from typing import Any

import pytest


class CallCounter:
    """``owner.name`` wrapped for the test (``monkeypatch`` undoes it): :attr:`calls` counts the
    calls since the wrapper went in or since a test last set it (``counter.calls = 0``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> None:
        self.calls = 0
        original = getattr(owner, name)

        def counting(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counting)


def require_router_merge_plan(device: Any, experts: int, hidden: int) -> None:
    """Skip unless the dense GEMV's table has a split plan merged by its last split for a router of
    ``experts`` x ``hidden`` on ``device``'s SM count: the plan the fused router kernels run on."""
    import torch

    from loom.layers import dense_gemv_table

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    entry = dense_gemv_table.PLANS.get((sms, experts, hidden))
    if entry is None or not entry[-1]:
        pytest.skip(f"the dense GEMV table has no split-merging plan for the router on {sms} SMs")
