"""The dense Triton GEMV for 1-4 rows (``loom.layers.dense_gemv``), checked without a GPU: the kernel
through Triton's interpreter against a float64 reference (and rows batch-invariant), its K loop
compiled for sm_90 (no launch), the table lookup and switches, and the sweep script's choice and
table writing. tests/gpu/test_dense_gemv_gpu.py runs it on CUDA."""

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
def test_dense_gemv_matches_reference_in_interpreter() -> None:
    stdout = run_interpreted(str(ROOT / "tests" / "helpers" / "dense_gemv_interpret_check.py"))
    assert "FAIL" not in stdout and "cases passed" in stdout, stdout


@needs_triton
def test_dense_gemv_compiles_for_hopper_to_async_copies_and_tensor_cores(tmp_path: Path) -> None:
    """Every plan's K loop (sm_90, no GPU): the weights move by 16-byte cp.async (a tile's bytes
    over 16 a thread, plus the activations'), the products run on the tensor cores, nothing
    spills, and the loop costs at most 4 instructions a weight (1.5 for the rule's 64 x 128 tile
    when written: well under what the bytes allow)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "sass.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "dense_gemv_sass.py"), "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["results"]
    assert len(rows) == 5
    for r in rows:
        assert r["spills"] == 0 and r["tensor_core"] > 0, r
        assert r["async_copies"] >= r["weights_per_thread"] * 2 // 16, r
        assert r["instructions_per_weight"] <= 4.0, r
    assert rows[0]["instructions_per_weight"] <= 2.0, rows[0]


def test_table_lookup_serves_only_the_listed_shapes_and_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    from loom.layers import dense_gemv as dg
    from loom.layers import dense_gemv_table

    monkeypatch.setattr(dense_gemv_table, "PLANS", {(132, 5120, 2048): (2, 64, 128, 8, 4, 3, True)})
    assert dg.table_plan(5120, 2048, 1, 132) == dg.GemvPlan(64, 128, 8, 4, 3, True)
    assert dg.table_plan(5120, 2048, 2, 132) == dg.GemvPlan(64, 128, 8, 4, 3, True)
    assert dg.table_plan(5120, 2048, 3, 132) is None  # measured faster only up to 2 rows
    assert dg.table_plan(5120, 2048, 1, 108) is None  # another GPU: not measured there
    assert dg.table_plan(2048, 4096, 1, 132) is None


def test_default_plan_and_cpu_tensors_stay_on_torch() -> None:
    from loom.layers import dense_gemv as dg

    p = dg.default_plan(5120, 2048, 132)
    assert (p.block_n, p.block_k, p.num_warps, p.num_stages, p.fused_reduce) == (64, 128, 4, 3, False)
    assert p.split == 8  # 80 tiles: 640 programs reach 4 an SM
    assert dg.plan_for(torch.zeros(1, 8), torch.zeros(4, 8)) is None  # CPU: F.linear


def test_switch_values() -> None:
    from loom.kernel_switches import _dense_gemv_mode

    assert [_dense_gemv_mode(v) for v in ("", "table", "1", "0", "off", "ALL", "all ")] == [
        "table", "table", "table", "off", "off", "all", "all"]


def _sweep() -> object:
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_dense_gemv

    return bench_dense_gemv


def _cand(bn: int, split: int, s: float, ok: bool = True) -> dict[str, object]:
    return {"plan": {"block_n": bn, "block_k": 128, "split": split, "num_warps": 4, "num_stages": 3,
                     "fused_reduce": False}, "s": s, "ok": ok}


def test_sweep_choice_serves_the_rows_it_wins_at_every_smaller_count(tmp_path: Path) -> None:
    bench = _sweep()
    rows = [  # cuBLAS 10 us at every M; plan A wins at 1-2 rows only, plan B at 1-4 by less
        {"m": 1, "cublas_s": 10e-6, "candidates": [_cand(64, 8, 6e-6), _cand(32, 4, 8e-6), _cand(16, 2, 1e-6, False)]},
        {"m": 2, "cublas_s": 10e-6, "candidates": [_cand(64, 8, 6e-6), _cand(32, 4, 8e-6)]},
        {"m": 3, "cublas_s": 10e-6, "candidates": [_cand(64, 8, 11e-6), _cand(32, 4, 8e-6)]},
        {"m": 4, "cublas_s": 10e-6, "candidates": [_cand(64, 8, 6e-6), _cand(32, 4, 9.2e-6)]},
    ]
    choice = bench.choose(rows, 0.05)  # type: ignore[attr-defined]
    # A saves 8 us over M 1-2 (M 3 breaks it); B saves 2 + 2 + 2 + 0.8 = 6.8 us over M 1-4.
    assert choice["plan"]["block_n"] == 64 and choice["serve_m"] == 2, choice
    assert bench.choose([dict(r, cublas_s=5e-6) for r in rows], 0.05) is None  # type: ignore[attr-defined]

    results = tmp_path / "gemv.json"
    choice.update(model="qwen3-30b-a3b", layer="qkv_proj", n=5120, k=2048)
    results.write_text(json.dumps({"sms": 132, "device": "NVIDIA H200", "cold_l2": True, "margin": 0.05,
                                   "choices": [choice]}))
    table = tmp_path / "table.py"
    table.write_text((ROOT / "service" / "loom" / "layers" / "dense_gemv_table.py").read_text())
    for _ in range(2):  # rewriting a filled table replaces its entries
        lines = bench.fill_table(results, table)  # type: ignore[attr-defined]
    assert len(lines) == 1 and table.read_text().count("# From ") == 1
    spec = importlib.util.spec_from_file_location("filled_table", table)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.PLANS == {(132, 5120, 2048): (2, 64, 128, 8, 4, 3, False)}


@needs_triton
def test_sweep_script_runs_in_the_interpreter(tmp_path: Path) -> None:
    out = tmp_path / "gemv.json"
    run_interpreted(str(ROOT / "scripts" / "bench_dense_gemv.py"), "--interpret", "--out", str(out))
    data = json.loads(out.read_text())
    assert len(data["shapes"]) == 2 and all(len(s["rows"]) == 2 for s in data["shapes"])
    assert all(c.get("ok") for s in data["shapes"] for r in s["rows"] for c in r["candidates"]), data
