"""The quantizers' Triton kernels (W4A16 GEMV / GEMM / dequantize for GPTQ, AWQ and NF4; the FP8
activation quantizer) checked on the CPU through Triton's interpreter.

Skipped where triton is not installed. The check runs in a child process: the interpreter is
chosen when the kernels are defined, and must not leak into a process that compiles them for a
GPU. The cases and the error bound are in tests/helpers/quant_interpret_check.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.triton_interpret import run_interpreted

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_quant_kernels_match_reference_in_interpreter() -> None:
    stdout = run_interpreted(str(ROOT / "tests" / "helpers" / "quant_interpret_check.py"))
    assert "FAIL" not in stdout
    assert "cases passed" in stdout, stdout


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_integer_code_gemv_compiles_for_hopper_to_few_instructions_a_weight(tmp_path: Path) -> None:
    """The one-token GEMV of integer codes through Triton's compiler for sm_90 (no GPU, no launch;
    ``scripts/w4a16_sass.py``): no integer-to-float conversion and no spill in its K loop, and at
    most 0.6x the general GEMV's instructions a weight for the same plan (4.8 against 13.4 for
    llama-8b's 4-bit plan when written), so that it can keep up with the weights' bytes."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "sass.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "w4a16_sass.py"), "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["case"]: r for r in json.loads(out.read_text())["results"]}
    fast = [r for r in rows.values() if r["kernel"] == "gemv-int"]
    assert len(fast) == 5
    for r in fast:
        general = rows[r["case"].replace("gemv-int", "gemv", 1)]
        assert r["conversions"] == 0 and r["spills"] == 0, r
        assert r["instructions_per_weight"] <= 0.6 * general["instructions_per_weight"], (r, general)
