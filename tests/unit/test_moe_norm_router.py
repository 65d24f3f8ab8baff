"""The residual norm before an MoE block and its router in one launch (``loom.layers.moe_norm_router``)
on a machine without a GPU: the kernel through Triton's interpreter and compiled for sm_90 (each in a
child process), the switch, and the block's ``forward_with_norm`` on the CPU (the two plain steps)."""

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
from loom.layers.fused_moe import SparseMoeBlock
from loom.layers.moe_norm_router import norm_router_plan
from loom.layers.norm import RMSNorm

ROOT = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@needs_triton
def test_norm_and_router_in_one_launch_give_the_two_launches_bits_in_the_interpreter() -> None:
    stdout = run_interpreted(str(ROOT / "tests" / "helpers" / "norm_router_interpret_check.py"), extra_env={"LOOM_CPU_KERNELS": "0"})
    # 4 cases, 1 refusal line, 4 warp-ordered sums
    assert "FAIL" not in stdout and stdout.count("ok  ") == 9, stdout


@needs_triton
def test_norm_router_compiles_for_hopper_and_sums_in_the_norms_order() -> None:
    """Compiled for sm_90 (no GPU needed): the norm kernel's sum of squares has the layout (8 values
    a thread, 32 lanes, NW warps) and butterflies the fused kernel reproduces with warp rows then
    pairwise adds; every other float32 reduction and the dot as the router kernel's; no spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers" / "layout_compile_check.py"),
                           "norm_router"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and "FAIL" not in proc.stdout, proc.stdout + proc.stderr
    assert proc.stdout.count("ok  ") == 3, proc.stdout


def test_the_switch_and_the_cpu_keep_the_two_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(1, 2048)
    assert norm_router_plan(x, x.clone(), torch.ones(2048), torch.randn(128, 2048), 8) is None  # CPU
    monkeypatch.setattr(kernel_switches, "moe_norm_router", False)
    assert norm_router_plan(x, x.clone(), torch.ones(2048), torch.randn(128, 2048), 8) is None


@pytest.mark.parametrize("t", [1, 3])
def test_forward_with_norm_is_the_norm_then_the_block_on_the_cpu(t: int) -> None:
    torch.manual_seed(t)
    block = SparseMoeBlock(8, 2, 32, 24, renormalize=True, weights_in_logits_dtype=True)
    for p in block.parameters():
        p.data.normal_(0, 0.2)
    norm = RMSNorm(32)
    norm.weight.data.normal_(1, 0.3)
    x, residual = torch.randn(t, 32), torch.randn(t, 32)
    got, got_h = block.forward_with_norm(x, residual, norm)
    hidden, want_h = norm.forward_with_residual(x, residual)
    want = block.forward_uncombined(hidden)
    assert isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)
    assert torch.equal(got, want) and torch.equal(got_h, want_h)
