"""The quantizers' Triton kernels (W4A16 GEMV / GEMM / dequantize for GPTQ, AWQ and NF4; the FP8
activation quantizer) checked on the CPU through Triton's interpreter.

Skipped where triton is not installed. The check runs in a child process: the interpreter is
chosen when the kernels are defined, and must not leak into a process that compiles them for a
GPU. The cases and the error bound are in tests/helpers/quant_interpret_check.py.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_quant_kernels_match_reference_in_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "quant_interpret_check.py")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAIL" not in proc.stdout
    assert "cases passed" in proc.stdout, proc.stdout
