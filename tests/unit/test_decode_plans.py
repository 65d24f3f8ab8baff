"""The paged backend's decode planner (``loom_plugins.attention.decode_plans``): today's rule by
default, the measured table's plan where it has one, and the sweep script's choice and table
writing. The kernels under each plan are checked in Triton's interpreter
(tests/helpers/paged_interpret_check.py) and on the GPU (tests/gpu/test_paged_decode_plans_gpu.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from helpers.triton_interpret import run_interpreted

from loom import kernel_switches
from loom_plugins.attention import decode_plan_table
from loom_plugins.attention.decode_plans import DecodePlan, choose_num_splits, plan_decode

ROOT = Path(__file__).resolve().parents[2]
QWEN3 = (4, 8, 128)  # KV heads, query heads each, head size


def test_without_a_table_entry_the_plan_is_todays_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode_plan_table, "PLANS", {})  # (the H200's measured entries aside)
    for n in (1, 2, 3, 8, 16, 64, 256):
        for hkv, group, d in (QWEN3, (8, 4, 128), (3, 3, 64), (8, 1, 128)):
            for max_len in (128, 600, 2048, 4096, 40960):
                plan = plan_decode(n, hkv, group, d, max_len, 132)
                assert plan == DecodePlan(choose_num_splits(n, hkv, max_len, 132)), (n, hkv, max_len)
    assert choose_num_splits(1, 4, 4096, 132) == 16 and choose_num_splits(1, 4, 2048, 132) == 8


@pytest.fixture
def qwen3_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode_plan_table, "PLANS", {
        (132, *QWEN3, 1): (32, 128, 32, 2, 2, True),
        (132, *QWEN3, 2): (16, 0, None, None, None, False),
    })


@pytest.mark.usefixtures("qwen3_entries")
def test_a_table_entry_serves_its_layout_from_its_batch_up_to_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    from loom_plugins.attention import fp8_decode_plan_table

    monkeypatch.setattr(fp8_decode_plan_table, "PLANS", {})  # FP8 pools' own table: test_fp8_decode_plans.py
    assert plan_decode(1, *QWEN3, 4096, 132) == DecodePlan(32, 128, 32, 2, 2, True)
    assert plan_decode(2, *QWEN3, 4096, 132) == DecodePlan(16)
    assert plan_decode(3, *QWEN3, 4096, 132) == DecodePlan(16)  # the entry of 2 serves 2-3
    assert plan_decode(4, *QWEN3, 4096, 132) == DecodePlan(choose_num_splits(4, 4, 4096, 132))  # no entry of 4
    assert plan_decode(1, *QWEN3, 4096, 108) == DecodePlan(choose_num_splits(1, 4, 4096, 108))  # another GPU
    assert plan_decode(1, 8, 4, 128, 4096, 132) == DecodePlan(choose_num_splits(1, 8, 4096, 132))  # another layout
    assert plan_decode(1, *QWEN3, 4096, 132, fp8_pool=True) == DecodePlan(16)  # FP8 pools: not this table's plans


@pytest.mark.usefixtures("qwen3_entries")
def test_a_short_bound_keeps_only_the_splits_its_longest_sequence_fills() -> None:
    # min_keys 128: 600 keys need 5 pieces -> 8 (a power of two at or above), fused still
    assert plan_decode(1, *QWEN3, 600, 132) == DecodePlan(8, 128, 32, 2, 2, True)
    assert plan_decode(1, *QWEN3, 100, 132) == DecodePlan(1, 128, 32, 2, 2, False)  # one piece: no merge
    assert plan_decode(1, *QWEN3, 4096, 132).num_splits == 32


@pytest.mark.usefixtures("qwen3_entries")
def test_the_switch_keeps_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_switches, "paged_decode_table", False)
    assert plan_decode(1, *QWEN3, 4096, 132) == DecodePlan(16)


@pytest.mark.usefixtures("qwen3_entries")
def test_the_backend_hands_the_plan_to_the_decode_launch() -> None:
    from helpers.paged_cases import make_step

    from loom_plugins.attention.paged_triton import PagedAttentionBackend

    step = make_step([(300, 1)], num_heads=32, num_kv_heads=4, head_dim=128)
    backend = PagedAttentionBackend(32, 4, 128, torch.float32, torch.device("cpu"))  # 132 SMs off CUDA
    plan = backend.prepare(step.meta)
    assert (plan.num_splits, plan.min_keys, plan.block_n, plan.num_warps, plan.num_stages, plan.fused_combine) == (
        4, 128, 32, 2, 2, True)  # 301 keys: 3 pieces of 128 -> 4


def _sweep() -> object:
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_decode_plans

    return bench_decode_plans


def _cand(splits: int, s: float, ok: bool = True) -> dict[str, object]:
    return {"plan": {"num_splits": splits, "min_keys": 0, "block_n": None, "num_warps": None, "num_stages": None,
                     "fused_combine": False}, "s": s, "ok": ok}


def test_sweep_choice_and_table(tmp_path: Path) -> None:
    bench = _sweep()
    rule = _cand(16, 0)["plan"]
    rows = [  # the rule (16 splits) against 4 and 32 splits at two contexts
        {"ctx": 128, "rule": rule, "candidates": [_cand(16, 6e-6), _cand(4, 4e-6), _cand(32, 7e-6), _cand(2, 1e-6, False)]},
        {"ctx": 4096, "rule": rule, "candidates": [_cand(16, 9e-6), _cand(4, 12e-6), _cand(32, 8e-6)]},
    ]
    choice = bench.choose(rows)  # type: ignore[attr-defined]
    # scores (geometric means of time over the best): 16: sqrt(1.5 * 1.125), 4: sqrt(1 * 1.5), 32: sqrt(1.75 * 1)
    assert choice["plan"]["num_splits"] == 4, choice
    assert choice["speedup_vs_rule"] == pytest.approx(((6 / 4) * (9 / 12)) ** 0.5)
    choice.update(layout="qwen3-30b-a3b", hkv=4, group=8, head_dim=128, batch=1)
    results = tmp_path / "decode.json"
    results.write_text(json.dumps({"sms": 132, "bound": 4096, "device": "NVIDIA H200", "cold_l2": True,
                                   "choices": [choice]}))
    table = tmp_path / "table.py"
    table.write_text((ROOT / "plugins" / "attention" / "decode_plan_table.py").read_text())
    assert bench.fill_table(results, 0.1, table) == []  # type: ignore[attr-defined]  # 1.06x: under 10%
    lines = bench.fill_table(results, 0.0, table)  # type: ignore[attr-defined]
    assert len(lines) == 1 and table.read_text().count("# From ") == 1
    spec = importlib.util.spec_from_file_location("filled_table", table)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.PLANS == {(132, 4, 8, 128, 1): (4, 0, None, None, None, False)}


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_sweep_script_runs_in_the_interpreter(tmp_path: Path) -> None:
    out = tmp_path / "decode.json"
    run_interpreted(str(ROOT / "scripts" / "bench_decode_plans.py"), "--interpret", "--out", str(out))
    data = json.loads(out.read_text())
    assert len(data["cases"]) == 2 and len(data["choices"]) == 1
    assert all(c.get("ok") for case in data["cases"] for c in case["candidates"]), data
