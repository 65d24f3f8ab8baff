"""The one-launch greedy pick (``loom.sample.greedy_triton``) on a machine without a GPU: the kernel
through Triton's interpreter (in a child process) against the sampler's torch path, and where the
sampler takes it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.triton_interpret import run_interpreted

from loom import kernel_switches
from loom.sample import greedy_triton

ROOT = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@needs_triton
def test_the_greedy_kernel_picks_the_torch_paths_tokens_in_the_interpreter() -> None:
    stdout = run_interpreted(str(ROOT / "tests" / "helpers" / "greedy_interpret_check.py"))
    # 6 vocabulary sizes, 2 sampler steps that take it, 2 that do not
    assert "FAIL" not in stdout and stdout.count("ok  ") == 10, stdout


def test_the_cpu_keeps_the_torch_path_outside_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.zeros(2, 100)
    assert not greedy_triton.serves(x)  # a CPU tensor: the general sampler (golden outputs unchanged)


@needs_triton
def test_what_the_kernel_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # serves() reads it; nothing is launched here
    assert greedy_triton.serves(torch.zeros(2, 100))
    assert not greedy_triton.serves(torch.zeros(2, 100, dtype=torch.float16))  # the sampler's logits are float32
    assert not greedy_triton.serves(torch.zeros(100, 2).t())  # strided along V
    assert not greedy_triton.serves(torch.zeros(0, 100))
    assert not greedy_triton.serves(torch.zeros(2, greedy_triton.BLOCK * greedy_triton.MAX_PIECES + 1))
    assert not greedy_triton.serves(torch.zeros(greedy_triton.MAX_ROWS + 1, 1))
    monkeypatch.setattr(kernel_switches, "greedy_kernel", False)
    assert not greedy_triton.serves(torch.zeros(2, 100))
    monkeypatch.setattr(kernel_switches, "greedy_kernel", True)
    monkeypatch.setattr(kernel_switches, "fused_kernels", False)
    assert not greedy_triton.serves(torch.zeros(2, 100))


@needs_triton
def test_the_greedy_kernel_compiles_for_hopper_without_spills() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "layout_compile_check.py"), "greedy"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and "ok   greedy" in proc.stdout, proc.stdout + proc.stderr
