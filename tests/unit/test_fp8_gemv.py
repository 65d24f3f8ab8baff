"""The FP8 weight-only GEMV for 1-4 rows (``loom_plugins.quant.fp8_gemv``), checked without a GPU: the
kernel through Triton's interpreter against the float64 W8A16 reference (rows batch-invariant),
its K loop compiled for sm_90 (no launch), the plan rule, the table and the switch, and the sweep
script on tiny shapes. tests/gpu/test_fp8_gemv_gpu.py runs it on CUDA."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.triton_interpret import run_interpreted

ROOT = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@needs_triton
def test_fp8_gemv_matches_w8a16_reference_in_interpreter() -> None:
    stdout = run_interpreted(str(ROOT / "tests" / "helpers" / "fp8_gemv_interpret_check.py"))
    assert "FAIL" not in stdout and "7 of 7 cases passed" in stdout, stdout
    assert "4 of 4 block cases passed" in stdout, stdout  # block-wise FP8 (one scale per block)


@needs_triton
def test_fp8_gemv_compiles_for_hopper_with_one_conversion_a_pair(tmp_path: Path) -> None:
    """The K loop (sm_90, no GPU): e4m3 tiles move by cp.async, the products run on the tensor
    cores, nothing spills, and the code conversions stay near one F2FP per pair of weights (bf16
    activations add their own, a sixteenth-row tile's worth) so that the quarter-rate conversion
    pipe keeps up with one byte a weight: at most 0.7 a weight, at most 3.5 instructions a weight
    (2.99 and 0.63 for the rule's 64 x 256 tile with bf16 when written)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "sass.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "dense_gemv_sass.py"), "--fp8", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["results"]
    assert len(rows) == 5  # the last: block-wise scales (128 x 128)
    for r in rows:
        assert r["spills"] == 0 and r["tensor_core"] > 0, r
        assert r["async_copies"] >= r["weights_per_thread"] // 16, r  # one byte a weight
        assert "F2F" not in r["by_opcode"], r  # no conversion through float32 per weight
    for r in rows[:3]:  # 64- and 128-row tiles (the 32-row one converts a 16-row x tile per 32 weights)
        assert r["by_opcode"].get("F2FP", 0) / r["weights_per_thread"] <= 0.7, r
        assert r["instructions_per_weight"] <= 3.5, r


def test_default_plan_on_llama_8b_shapes() -> None:
    from loom_plugins.quant import fp8_gemv

    # (N, K) -> split on 132 SMs: 64 x 256 tiles until ~4 programs an SM, at most 16 pieces (down_proj:
    # 56 K tiles in 16 pieces is 4 tiles a piece, recounted as 14 pieces)
    expected = {(6144, 4096): 8, (4096, 4096): 16, (28672, 4096): 2, (4096, 14336): 14, (50, 200): 1}
    for (n, k), split in expected.items():
        p = fp8_gemv.default_plan(n, k, 132)
        assert (p.block_n, p.block_k, p.num_warps, p.num_stages, p.split) == (64, 256, 4, 3, split), (n, k, p)
        assert p.fused_reduce == (split > 1)


def test_table_overrides_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    from loom.layers import dense_gemv as dg
    from loom_plugins.quant import fp8_gemv, fp8_gemv_table

    monkeypatch.setattr(fp8_gemv_table, "PLANS", {(132, 4096, 4096): (2, 128, 128, 8, 4, 3, True)})
    assert fp8_gemv.table_plan(4096, 4096, 1, 132) == dg.GemvPlan(128, 128, 8, 4, 3, True)
    assert fp8_gemv.table_plan(4096, 4096, 2, 132) == dg.GemvPlan(128, 128, 8, 4, 3, True)
    assert fp8_gemv.table_plan(4096, 4096, 3, 132) is None  # measured faster than W8A8 only up to 2 rows
    assert fp8_gemv.table_plan(4096, 4096, 3, 108) == fp8_gemv.default_plan(4096, 4096, 108)  # not measured there
    assert fp8_gemv.table_plan(6144, 4096, 4, 132) == fp8_gemv.default_plan(6144, 4096, 132)
    assert fp8_gemv.table_plan(6144, 4096, 5, 132) is None
    monkeypatch.setattr(fp8_gemv_table, "PLANS", {(132, 4096, 4096): (0, 64, 256, 16, 4, 3, True)})
    assert fp8_gemv.table_plan(4096, 4096, 1, 132) is None  # measured: W8A8 was faster even at one row


def test_cpu_tensors_and_the_switch_keep_w8a8(monkeypatch: pytest.MonkeyPatch) -> None:
    from loom import kernel_switches
    from loom_plugins.quant import fp8_gemv

    codes = torch.zeros(32, 64).to(torch.float8_e4m3fn)
    assert fp8_gemv.plan_for(torch.zeros(1, 64, dtype=torch.bfloat16), codes) is None  # CPU: the emulation
    assert fp8_gemv.maybe_fp8_gemv(torch.zeros(1, 64, dtype=torch.bfloat16), codes, torch.ones(32), None) is None
    monkeypatch.setattr(kernel_switches, "fp8_gemv", False)
    assert fp8_gemv.plan_for(torch.zeros(1, 64, dtype=torch.bfloat16), codes) is None


@needs_triton
def test_sweep_script_runs_in_the_interpreter(tmp_path: Path) -> None:
    out = tmp_path / "fp8gemv.json"
    run_interpreted(str(ROOT / "scripts" / "bench_fp8_gemv.py"), "--interpret", "--out", str(out))
    data = json.loads(out.read_text())
    assert data["baseline"] == "w8a8" and len(data["shapes"]) == 2
    assert all(len(s["rows"]) == 2 and s["rows"][0]["rule_s"] is not None for s in data["shapes"])
    assert all(c.get("ok") for s in data["shapes"] for r in s["rows"] for c in r["candidates"]), data
    assert [c["n"] for c in data["choices"]] == [48, 20]  # an entry per shape (0 rows where W8A8 won)
    # the table the sweep would fill is the FP8 GEMV's own, and it parses as the empty table does
    table = tmp_path / "table.py"
    table.write_text((ROOT / "plugins" / "quant" / "fp8_gemv_table.py").read_text())
    data["choices"] = [{"plan": {"block_n": 64, "block_k": 256, "split": 8, "num_warps": 4, "num_stages": 3,
                                 "fused_reduce": True}, "serve_m": 4, "us": {}, "cublas_us": {},
                        "model": "llama-8b", "layer": "qkv_proj", "n": 6144, "k": 4096}]
    out.write_text(json.dumps(data))
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_dense_gemv

    bench_dense_gemv.fill_table(out, table)
    spec = importlib.util.spec_from_file_location("filled_fp8_table", table)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.PLANS == {(8, 6144, 4096): (4, 64, 256, 8, 4, 3, True)}


def test_warm_up_counts_compile_both_variants(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counts 1 and 2 (Triton specialises M == 1; 2-4 share a variant) for a layer prepared for
    CUDA; none for a CPU layer or with the GEMV off. Both FP8 methods ask for them."""
    from loom import kernel_switches
    from loom_plugins.quant import fp8, fp8_gemv

    layer = torch.nn.Module()
    assert fp8_gemv.layer_warm_up_token_counts(layer, 4096) == ()
    layer.__dict__["fp8_gpu"] = object()
    assert fp8_gemv.layer_warm_up_token_counts(layer, 4096) == ((1, 2) if fp8_gemv.dg.HAS_TRITON else ())
    if fp8_gemv.dg.HAS_TRITON:
        assert fp8_gemv.layer_warm_up_token_counts(layer, 1) == (1,)
        assert list(fp8.FP8WhileLoadingMethod().warm_up_token_counts(layer, 64)) == [1, 2]
        assert list(fp8.FP8LinearMethod(fp8.FP8Scheme(True, "dynamic")).warm_up_token_counts(layer, 64)) == [1, 2]
    monkeypatch.setattr(kernel_switches, "fp8_gemv", False)
    assert fp8_gemv.layer_warm_up_token_counts(layer, 4096) == ()


def test_fp8_gemm_passes_the_fast_accum_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``LOOM_FP8_FAST_ACCUM`` reaches every ``torch._scaled_mm`` call of the W8A8 path, on by
    default (measured on an H100: docs/quantization.md)."""
    import torch

    from loom import kernel_switches
    from loom_plugins.quant import fp8_triton

    assert kernel_switches.fp8_fast_accum is True
    seen: list[bool] = []

    def fake_scaled_mm(a: torch.Tensor, b: torch.Tensor, *, scale_a: torch.Tensor, scale_b: torch.Tensor,
                       out_dtype: torch.dtype, use_fast_accum: bool) -> torch.Tensor:
        seen.append(use_fast_accum)
        return torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    monkeypatch.setattr(fp8_triton, "quantize_rows",
                        lambda x, s: (x.to(torch.float8_e4m3fn), torch.ones(x.shape[0], 1)))
    weight = torch.zeros(32, 16, dtype=torch.float8_e4m3fn)
    row = torch.ones(1, 32)
    states = [fp8_triton.FP8GpuWeights(weight, row, None, None, True, torch.bfloat16),  # row-wise
              fp8_triton.FP8GpuWeights(weight, row, torch.ones(()), torch.ones(1), False, torch.bfloat16),
              fp8_triton.FP8GpuWeights(weight, row, None, None, False, torch.bfloat16)]  # float32 out, scaled after
    x = torch.zeros(8, 16, dtype=torch.bfloat16)
    for fast in (False, True):
        monkeypatch.setattr(kernel_switches, "fp8_fast_accum", fast)
        for state in states:
            assert fp8_triton.fp8_linear(x, state, None).shape == (8, 32)
    assert seen == [False] * 3 + [True] * 3


def test_block_plan_tiles_within_blocks_and_splits_in_whole_blocks() -> None:
    """Block-wise FP8's GEMV rule: K tiles inside one scale block (128 for 128-input blocks, 64 for
    64), the split counted in blocks, and no plan on the CPU (the layer dequantizes there)."""
    from loom_plugins.quant import fp8_gemv

    p = fp8_gemv.block_plan(4096, 4096, (128, 128), 132)
    assert (p.block_n, p.block_k, p.num_warps, p.num_stages) == (64, 128, 4, 3) and p.fused_reduce == (p.split > 1)
    assert fp8_gemv.block_plan(4096, 4096, (128, 64), 132).block_k == 64
    assert fp8_gemv.block_plan(4096, 4096, (128, 96), 132).block_k == 32
    import torch

    codes = torch.zeros(64, 128, dtype=torch.float8_e4m3fn)
    assert fp8_gemv.block_plan_for(torch.zeros(1, 128, dtype=torch.bfloat16), codes, (128, 128)) is None
