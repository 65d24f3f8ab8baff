"""``jit``: Triton's ``triton.jit`` where Triton is installed. Without it the kernels stay plain
Python functions that are never launched (every caller checks its module's ``HAS_TRITON`` before
a launch), so the modules that define kernels import on a machine without Triton."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    import triton

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False


def jit(fn: Callable[..., Any]) -> Any:
    """``triton.jit(fn)``, or ``fn`` itself without Triton."""
    return triton.jit(fn) if HAS_TRITON else fn
