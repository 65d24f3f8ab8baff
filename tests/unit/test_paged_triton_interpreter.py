"""The ``paged`` backend's Triton kernels checked on the CPU through Triton's interpreter.

Skipped where triton is not installed (a CPU-only torch does not bring it). The check runs in
a child process: the interpreter is chosen when the kernels are defined, and must not leak into
a process that also compiles them for a GPU.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from helpers.triton_interpret import run_interpreted

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_paged_kernels_match_reference_in_interpreter() -> None:
    stdout = run_interpreted(str(ROOT / "tests" / "helpers" / "paged_interpret_check.py"))
    assert "FAIL" not in stdout
