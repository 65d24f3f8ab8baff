"""The FP8 kernel's decode plans (``loom_plugins.attention.fp8_decode_plans``): today's rule while
its table is empty, the measured entry where it has one (from its batch up to the next, the last
one for every larger batch), the switches that keep the rule, and the sweep script's choice,
table writing and run in Triton's interpreter. The kernel under each plan is checked in the
interpreter (tests/helpers/paged_interpret_check.py) and on the GPU
(tests/gpu/test_fp8_decode_plans_gpu.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from helpers.triton_interpret import run_interpreted

from loom import kernel_switches
from loom_plugins.attention import fp8_decode_plan_table
from loom_plugins.attention.decode_plans import DecodePlan, choose_num_splits, plan_decode

ROOT = Path(__file__).resolve().parents[2]
LLAMA = (8, 4, 128)  # KV heads, query heads each, head size


def test_without_a_table_entry_the_fp8_plan_is_todays_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp8_decode_plan_table, "PLANS", {})  # (the H200's measured entries aside)
    for n in (1, 4, 16, 64, 256, 300):
        for hkv, group, d in (LLAMA, (4, 8, 128)):
            for max_len in (128, 600, 4096):
                plan = plan_decode(n, hkv, group, d, max_len, 132, fp8_pool=True)
                assert plan == DecodePlan(choose_num_splits(n, hkv, max_len, 132)), (n, hkv, max_len)


@pytest.fixture
def llama_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp8_decode_plan_table, "PLANS", {
        (132, *LLAMA, 1): (16, 128, 2, 2, None, False),
        (132, *LLAMA, 64): (2, 32, 1, 2, 128, False),
        (132, *LLAMA, 256): (1, 32, 1, 3, 128, True),
    })


@pytest.mark.usefixtures("llama_entries")
def test_an_entry_serves_its_batch_up_to_the_next_and_the_last_every_larger_one() -> None:
    assert plan_decode(1, *LLAMA, 4096, 132, fp8_pool=True) == DecodePlan(16, 0, 128, 2, 2, False, None, False)
    assert plan_decode(3, *LLAMA, 4096, 132, fp8_pool=True) == DecodePlan(16, 0, 128, 2, 2, False, None, False)
    rule4 = DecodePlan(choose_num_splits(4, 8, 4096, 132))
    assert plan_decode(4, *LLAMA, 4096, 132, fp8_pool=True) == rule4  # no entry of 4: the rule
    assert plan_decode(100, *LLAMA, 4096, 132, fp8_pool=True) == DecodePlan(2, 0, 32, 1, 2, False, 128, False)
    assert plan_decode(256, *LLAMA, 4096, 132, fp8_pool=True) == DecodePlan(1, 0, 32, 1, 3, False, 128, True)
    assert plan_decode(512, *LLAMA, 4096, 132, fp8_pool=True) == DecodePlan(1, 0, 32, 1, 3, False, 128, True)
    assert plan_decode(256, *LLAMA, 4096, 108, fp8_pool=True) == DecodePlan(1)  # another GPU: the rule
    # the bf16 pool's planner never reads the FP8 table
    assert plan_decode(256, *LLAMA, 4096, 132) == DecodePlan(choose_num_splits(256, 8, 4096, 132))


@pytest.mark.usefixtures("llama_entries")
def test_a_short_bound_keeps_only_the_splits_its_longest_sequence_fills() -> None:
    # 16 splits of 128-key tiles: 600 keys fill 5 -> 8 (a power of two at or above); 100 keys one
    assert plan_decode(1, *LLAMA, 600, 132, fp8_pool=True) == DecodePlan(8, 0, 128, 2, 2, False, None, False)
    assert plan_decode(1, *LLAMA, 100, 132, fp8_pool=True) == DecodePlan(1, 0, 128, 2, 2, False, None, False)


@pytest.mark.usefixtures("llama_entries")
@pytest.mark.parametrize("switch", ["paged_decode_table", "fp8_kv_kernel"])
def test_the_switches_keep_the_rule(monkeypatch: pytest.MonkeyPatch, switch: str) -> None:
    monkeypatch.setattr(kernel_switches, switch, False)
    assert plan_decode(256, *LLAMA, 4096, 132, fp8_pool=True) == DecodePlan(1)


@pytest.mark.usefixtures("llama_entries")
def test_the_backend_hands_the_fp8_plan_to_the_decode_launch() -> None:
    from helpers.paged_cases import make_step

    from loom_plugins.attention.paged_triton import PagedAttentionBackend

    step = make_step([(300, 1)] * 64, num_heads=32, num_kv_heads=8, head_dim=128)
    backend = PagedAttentionBackend(32, 8, 128, torch.bfloat16, torch.device("cpu"))  # 132 SMs off CUDA
    backend.use_fp8_kv_cache()
    plan = backend.prepare(step.meta)
    got = (plan.num_splits, plan.block_n, plan.num_warps, plan.num_stages, plan.max_registers, plan.prefetch_table)
    assert got == (2, 32, 1, 2, 128, False)


def _sweep() -> object:
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_fp8_decode_plans

    return bench_fp8_decode_plans


def _cand(splits: int, s: float, block_n: int | None = None, ok: bool = True) -> dict[str, object]:
    return {"plan": {"num_splits": splits, "block_n": block_n, "num_warps": None if block_n is None else 1,
                     "num_stages": None, "max_registers": None if block_n is None else 128,
                     "prefetch_table": block_n is not None}, "s": s, "ok": ok}


def test_sweep_choice_and_table(tmp_path: Path) -> None:
    bench = _sweep()
    rule = _cand(1, 0)["plan"]
    rows = [  # the rule against 32-key tiles unsplit and split in two, at two contexts
        {"ctx": 512, "kv_bytes": 1e8, "rule": rule,
         "candidates": [_cand(1, 100e-6), _cand(1, 80e-6, 32), _cand(2, 90e-6, 32), _cand(4, 1e-6, 32, False)]},
        {"ctx": 2048, "kv_bytes": 4e8, "rule": rule,
         "candidates": [_cand(1, 400e-6), _cand(1, 300e-6, 32), _cand(2, 310e-6, 32)]},
    ]
    choice = bench.choose(rows)  # type: ignore[attr-defined]
    assert choice["plan"] == _cand(1, 0, 32)["plan"], choice
    assert choice["speedup_vs_rule"] == pytest.approx(((100 / 80) * (400 / 300)) ** 0.5)
    assert choice["tb_s"] == {"512": 1.25, "2048": pytest.approx(1.333, abs=1e-3)}
    choice.update(layout="llama-8b", hkv=8, group=4, head_dim=128, batch=256)
    results = tmp_path / "fp8.json"
    results.write_text(json.dumps({"sms": 132, "bound": 4096, "device": "NVIDIA H200", "cold_l2": True,
                                   "choices": [choice]}))
    table = tmp_path / "table.py"
    table.write_text((ROOT / "plugins" / "attention" / "fp8_decode_plan_table.py").read_text())
    assert bench.fill_table(results, 0.5, table) == []  # type: ignore[attr-defined]  # 1.29x: under 50%
    lines = bench.fill_table(results, 0.03, table)  # type: ignore[attr-defined]
    assert len(lines) == 1 and table.read_text().count("# From ") == 1
    bench.fill_table(results, 0.03, table)  # type: ignore[attr-defined]  # rewriting keeps one generated part
    assert table.read_text().count("# From ") == 1
    spec = importlib.util.spec_from_file_location("filled_table", table)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.PLANS == {(132, 8, 4, 128, 256): (1, 32, 1, None, 128, True)}


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_sweep_script_runs_in_the_interpreter(tmp_path: Path) -> None:
    out = tmp_path / "fp8.json"
    run_interpreted(str(ROOT / "scripts" / "bench_fp8_decode_plans.py"), "--interpret", "--out", str(out))
    data = json.loads(out.read_text())
    assert len(data["cases"]) == 4 and len(data["choices"]) == 2
    assert all(c.get("ok") for case in data["cases"] for c in case["candidates"]), data
