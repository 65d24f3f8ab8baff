"""``LOOM_PDL`` (Programmatic Dependent Launch) without a GPU: the switch and the launch helper,
every decode kernel's ``USE_PDL`` parameter (off by default: the kernels compile as before), and
a few kernels compiled for sm_90 with it on (``scripts/pdl_sass.py``: the two grid-dependency
instructions, nothing read before the wait, the same registers)."""

from __future__ import annotations

import importlib.util
import inspect
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.triton_interpret import run_interpreted

from loom import kernel_switches
from loom.layers import triton_jit

ROOT = Path(__file__).resolve().parents[2]
HAS_TRITON = importlib.util.find_spec("triton") is not None


def test_switch_reads_the_environment() -> None:
    code = "from loom import kernel_switches as k; print(k.pdl)"
    for value, want in (("", "True"), ("0", "False"), ("off", "False"), ("1", "True"), ("on", "True")):
        env = {**os.environ, "LOOM_PDL": value, "PYTHONPATH": str(ROOT / "service")}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert out.stdout.strip() == want, (value, out.stdout, out.stderr)
    env = {k: v for k, v in os.environ.items() if k != "LOOM_PDL"}
    env["PYTHONPATH"] = str(ROOT / "service")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.strip() == "True"  # on by default since the H200 measured it (docs/gpu-kernels.md)


def test_no_pdl_on_the_cpu_or_when_off(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setattr(kernel_switches, "pdl", True)
    assert not triton_jit.pdl_enabled(cpu)
    assert dict(triton_jit.pdl_launch(cpu)) == {}
    monkeypatch.setattr(kernel_switches, "pdl", False)
    assert dict(triton_jit.pdl_launch(cpu)) == {}


def test_interpreter_never_uses_pdl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not triton_jit.triton_has_pdl()


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_this_triton_has_the_api() -> None:
    monkey_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "from loom.layers import triton_jit; print(triton_jit.triton_has_pdl())"
    monkey_env["PYTHONPATH"] = str(ROOT / "service")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=monkey_env, timeout=120)
    assert out.stdout.strip() == "True", out.stderr


def _decode_kernels() -> list[Any]:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.source_tree import make_importable

    make_importable()
    from loom.layers import (
        dense_gemv,
        fused_moe_triton,
        fused_ops,
        moe_norm_router,
        moe_router_gemv,
        moe_routing_triton,
        split_k,
    )
    from loom_plugins.attention import triton_fp8_attention, triton_kernels
    from loom_plugins.quant import fp8_triton, w4a16_triton

    return [dense_gemv._dense_gemv_kernel, split_k.split_sum_kernel, fused_ops._add_rms_norm_kernel,
            fused_ops._rotary_kernel, fused_ops._qk_norm_rotary_kernel, fused_ops._silu_and_mul_kernel,
            moe_router_gemv._router_route_kernel, moe_norm_router._norm_router_route_kernel,
            moe_routing_triton._route_kernel, moe_routing_triton._count_kernel,
            moe_routing_triton._place_kernel, moe_routing_triton._route_sort_kernel, fused_moe_triton._gate_up_kernel,
            fused_moe_triton._down_kernel, fused_moe_triton._combine_kernel, triton_kernels._store_kv_kernel,
            triton_kernels._paged_attn_kernel, triton_kernels._combine_kernel,
            triton_fp8_attention._paged_attn_fp8_kernel, triton_fp8_attention._combine_fp8_kernel,
            fp8_triton._quantize_rows_kernel, w4a16_triton._gemv_kernel, w4a16_triton._gemv_int_kernel,
            w4a16_triton._gemm_kernel]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_every_decode_kernel_takes_use_pdl_off_by_default() -> None:
    for kernel in _decode_kernels():
        fn = getattr(kernel, "fn", kernel)
        param = inspect.signature(fn).parameters.get("USE_PDL")
        assert param is not None, fn.__name__
        assert param.default is False, fn.__name__
        assert "pdl_prologue()" in inspect.getsource(fn), fn.__name__


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("only", ["store_kv", "add + RMSNorm", "split-K sum", "residual norm + MoE router"])
def test_kernels_compile_for_hopper_with_pdl(only: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "service"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "pdl_sass.py"), "--only", only],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok  ") >= 1 and "FAIL" not in proc.stdout, proc.stdout


_CHAIN = """
import sys, torch
sys.path.insert(0, {scripts!r}); sys.path.insert(0, {tests!r})
from helpers.triton_interpret import setup_script
setup_script()
import bench_pdl
for name in ("tiny-moe", "tiny-dense"):
    step, _ = bench_pdl.build_chain(bench_pdl.SHAPES[name], layers=2, ctx=40, device=torch.device("cpu"),
                                    max_seq_len=256, dtype=torch.float32)
    out = step()
    assert out.shape == (2, 256) and bool(torch.isfinite(out).all()), name
    print("ok", name)
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_bench_chain_runs_in_interpreter() -> None:
    """``scripts/bench_pdl.py``'s decode chain (its GPU test's too) runs through every launcher on
    the CPU in Triton's interpreter (float32: the check is of the chain's code, not of timing)."""
    code = _CHAIN.format(scripts=str(ROOT / "scripts"), tests=str(ROOT / "tests"))
    stdout = run_interpreted("-c", code)
    assert stdout.count("ok ") == 2, stdout
