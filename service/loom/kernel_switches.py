"""Switches of Loom's own fused kernels, read once from the environment when Loom is imported.

``LOOM_FUSED_KERNELS=0`` keeps every layer on its plain torch path (the Triton kernels on CUDA and
the fused CPU operators alike): for an operator who suspects a kernel, and as the reference the
kernels are tested against. The layers read :data:`fused_kernels`, a plain module attribute, on
each call: no environment lookup in the hot path. Tests and benchmarks switch it with
:func:`fused_kernels_off` (or by setting the attribute).

A narrower switch, read the same way:

- ``LOOM_PAGED_DECODE_TABLE=0`` (:data:`paged_decode_table`): the paged attention's decode
  launches keep the split rule written before measurement instead of the measured table
  (``loom_plugins.attention.decode_plan_table``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

fused_kernels: bool = os.environ.get("LOOM_FUSED_KERNELS", "1") != "0"

paged_decode_table: bool = os.environ.get("LOOM_PAGED_DECODE_TABLE", "1") != "0"


@contextlib.contextmanager
def fused_kernels_off() -> Iterator[None]:
    """Run the layers' plain torch code inside the block."""
    global fused_kernels
    before, fused_kernels = fused_kernels, False
    try:
        yield
    finally:
        fused_kernels = before
