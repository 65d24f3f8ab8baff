"""Sweep the dense Triton GEMV's plans against cuBLAS at 1-4 rows and fill its table from it.

cuBLAS leaves some skinny bf16 shapes well below the copy bandwidth at batch 1 on the H200
(Qwen3-30B-A3B's qkv_proj at 2.7 TB/s, its o_proj as split-K plus a reduce kernel at 1.9 TB/s,
its 2048 -> 128 router 5 us for 0.5 MB) while llama-8b's large layers reach ~95% of it. This
times ``loom.layers.dense_gemv`` on the dense layers of Qwen3-30B-A3B, llama-8b and SmolLM2 at
M = 1..4 rows beside ``torch.matmul`` (cuBLAS) on the same operands, every call replayed from a
CUDA graph with the L2 cold (``sweep_common.GraphTimer``: weights are read once a step), and the
weight-read limit (the weight's bytes over the measured copy bandwidth).

Two stages, to fit about a minute: the tiles (block_n, block_k, warps, stages) are ranked at one
row with the rule's split count; the best ``--tiles-kept`` of each shape then meet every split
count, merged by a second launch or by the last split, at every M. Per shape the choice is the
plan that saves the most time against cuBLAS summed over the row counts it serves, serving M
only if it beats cuBLAS by ``--margin`` at M and at every smaller M (one plan for all of them: a
row's result then does not depend on how many rows share the call). ``--fill-table`` writes the
choices into ``service/loom/layers/dense_gemv_table.py``.

    PYTHONPATH=service:plugins/.. python scripts/bench_dense_gemv.py --out gemv.json [--budget-s 50]
    python scripts/bench_dense_gemv.py --fill-table gemv.json          # on any machine
    python scripts/bench_dense_gemv.py --interpret                     # a CPU check of the script

Every candidate's output is compared with cuBLAS's (bf16: within 2e-2); one that differs is
reported and never chosen.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from sweep_common import Budget, Compiler, GraphTimer, copy_bandwidth  # noqa: E402
from sweep_tables import add_common_args, add_mode_args, entry_line, sweep_main, write_table  # noqa: E402

# (model, layer, N out features, K in features): the dense layers a decode step runs at M rows
SHAPES = [
    ("qwen3-30b-a3b", "qkv_proj", 5120, 2048), ("qwen3-30b-a3b", "o_proj", 2048, 4096),
    ("qwen3-30b-a3b", "router", 128, 2048),
    ("llama-8b", "qkv_proj", 6144, 4096), ("llama-8b", "o_proj", 4096, 4096),
    ("llama-8b", "gate_up_proj", 28672, 4096), ("llama-8b", "down_proj", 4096, 14336),
    ("smollm2", "qkv_proj", 960, 576), ("smollm2", "o_proj", 576, 576), ("smollm2", "gate_up_proj", 3072, 576),
    ("smollm2", "down_proj", 576, 1536), ("smollm2", "lm_head", 49152, 576),
]
ROWS = (1, 2, 3, 4)
# (block_n, block_k, num_warps, num_stages); the first is the rule's (dense_gemv.default_plan)
TILES = [(64, 128, 4, 3), (64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 3), (128, 64, 4, 4), (32, 128, 4, 4),
         (32, 256, 4, 3), (16, 256, 4, 4), (16, 512, 4, 3), (64, 64, 4, 6), (128, 128, 8, 3), (32, 512, 4, 2)]
SPLITS = (1, 2, 4, 8, 16, 32, 64)
TABLE = ROOT / "service" / "loom" / "layers" / "dense_gemv_table.py"


def _import() -> Any:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.source_tree import make_importable

    make_importable()
    from loom.layers import dense_gemv

    return dense_gemv


def rule_split(n: int, k: int, bn: int, bk: int, sms: int) -> int:
    """The split count of ``dense_gemv.default_plan``'s rule for this tile."""
    from loom.layers.split_k import split_k

    return int(split_k(-(-n // bn), k, bk, 4 * sms, 16)[0])


def _compile_task(task: tuple[int, int, list[int], list[dict[str, Any]]]) -> int:
    """Worker: run each plan once at each row count on the shape's own operands (the sweep's
    specialisation), so that its kernels are in Triton's cache."""
    n, k, rows, plans = task
    dg = _import()
    device = torch.device("cuda")
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    done = 0
    for m in rows:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        for p in plans:
            try:
                dg.dense_gemv(x, w, None, dg.GemvPlan(**p))
                done += 1
            except Exception:  # a plan the compiler refuses: the timing process reports it
                pass
    torch.cuda.synchronize()
    return done


def choose(rows: list[dict[str, Any]], margin: float) -> dict[str, Any] | None:
    """The plan that saves the most time against cuBLAS, summed over the row counts it serves:
    M = 1..serve_m, each at least ``margin`` faster than cuBLAS (and matching it)."""
    rows = sorted(rows, key=lambda r: r["m"])
    times: dict[str, dict[int, float]] = {}
    plans: dict[str, dict[str, Any]] = {}
    for r in rows:
        for c in r["candidates"]:
            if c.get("ok"):
                key = json.dumps(c["plan"], sort_keys=True)
                times.setdefault(key, {})[r["m"]] = c["s"]
                plans[key] = c["plan"]
    best: tuple[float, str, int] | None = None
    for key, t in times.items():
        serve, saved = 0, 0.0
        for r in rows:
            m = r["m"]
            if m not in t or t[m] > (1.0 - margin) * r["cublas_s"]:
                break
            serve, saved = m, saved + r["cublas_s"] - t[m]
        if serve and (best is None or saved > best[0]):
            best = (saved, key, serve)
    if best is None:
        return None
    saved, key, serve = best
    return {"plan": plans[key], "serve_m": serve, "saved_us": round(saved * 1e6, 2),
            "us": {str(r["m"]): round(times[key][r["m"]] * 1e6, 2) for r in rows if r["m"] in times[key]},
            "cublas_us": {str(r["m"]): round(r["cublas_s"] * 1e6, 2) for r in rows}}


def split_plans(dg: Any, kept: list[dict[str, Any]], splits: tuple[int, ...], k: int) -> list[Any]:
    """Stage 2's candidates: each kept stage-1 row's tile (block_n, block_k, warps, stages) at
    every split count that leaves every split a K tile, merged by a second launch or by the last
    split where it splits."""
    tiles = [(r["plan"]["block_n"], r["plan"]["block_k"], r["plan"]["num_warps"], r["plan"]["num_stages"])
             for r in kept]
    return [dg.GemvPlan(bn, bk, s, wp, st, fused) for bn, bk, wp, st in tiles for s in splits
            for fused in ((False, True) if s > 1 else (False,)) if s <= -(-k // bk)]


def time_plans(dg: Any, timer: GraphTimer, w: torch.Tensor, x: torch.Tensor, plans: list[Any],
               ref: torch.Tensor) -> list[dict[str, Any]]:
    """Each plan's time on ``x @ w^T`` and whether its output matches cuBLAS's ``ref``."""
    found: list[dict[str, Any]] = []
    for p in plans:
        try:
            s = timer(lambda p=p: dg.dense_gemv(x, w, None, p))
            y = dg.dense_gemv(x, w, None, p)
        except Exception as exc:  # a plan the compiler refuses
            found.append({"plan": asdict(p), "error": repr(exc)[:200]})
            continue
        found.append({"plan": asdict(p), "s": s, "ok": bool(torch.allclose(y.float(), ref, atol=2e-2, rtol=2e-2))})
    return found


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    dg = _import()
    device = torch.device("cpu" if args.interpret else "cuda")
    dtype = torch.float32 if args.interpret else torch.bfloat16
    budget = Budget(args.budget_s)
    shapes: list[tuple[str, str, int, int]]
    rows_m: tuple[int, ...]
    tiles: list[tuple[int, int, int, int]]
    splits: tuple[int, ...]
    if args.interpret:
        shapes, rows_m, sms = [("tiny", "a", 48, 96), ("tiny", "b", 20, 200)], (1, 2), 8
        tiles, splits = [(16, 32, 4, 2), (32, 64, 4, 2)], (1, 2, 4)
    else:
        wanted = set(args.models.split(",")) if args.models else None
        shapes = [s for s in SHAPES if wanted is None or s[0] in wanted]
        rows_m, tiles, splits = ROWS, TILES, SPLITS
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    compiler = Compiler(1 if args.interpret else args.jobs)
    timer = GraphTimer(device, cold=not args.warm)
    bandwidth = copy_bandwidth(device)
    result: dict[str, Any] = {"sms": sms, "cold_l2": not args.warm, "copy_bytes_per_s": bandwidth,
                              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "margin": args.margin, "shapes": [], "choices": []}

    def stage1_plans(n: int, k: int) -> list[Any]:
        return [dg.GemvPlan(bn, bk, rule_split(n, k, bn, bk, sms), w, st) for bn, bk, w, st in tiles]

    pending = {(n, k): compiler.submit(_compile_task, [(n, k, [1], [asdict(p) for p in stage1_plans(n, k)])])
               for _, _, n, k in shapes}
    try:
        for model, layer, n, k in shapes:
            if budget.spent():
                print(f"budget of {args.budget_s:.0f} s spent: stopping", flush=True)
                break
            compiler.wait(pending[(n, k)])
            gen = torch.Generator(device=device).manual_seed(n + k)  # drawn on the device: up to 235 MB
            w = (torch.randn(n, k, generator=gen, device=device) * 0.02).to(dtype)
            xs = {m: torch.randn(m, k, generator=gen, device=device).to(dtype) for m in rows_m}
            outs = {m: torch.empty(m, n, device=device, dtype=dtype) for m in rows_m}
            limit_s = n * k * w.element_size() / bandwidth

            cublas = {}
            refs = {}
            for m in rows_m:
                cublas[m] = timer(lambda x=xs[m], o=outs[m], w=w: torch.matmul(x, w.t(), out=o))
                refs[m] = outs[m].float().clone()
            # Stage 1: the tiles at one row, at the rule's split count.
            ranked = sorted((r for r in time_plans(dg, timer, w, xs[1], stage1_plans(n, k), refs[1]) if r.get("ok")),
                            key=lambda r: r["s"])
            # Stage 2: every split count and merge with the kept tiles, at every M.
            plans = split_plans(dg, ranked[: args.tiles_kept], splits, k)
            plans.append(dg.default_plan(n, k, sms))
            plans = list(dict.fromkeys(plans))
            compiler.wait(compiler.submit(_compile_task, [(n, k, [m], [asdict(p) for p in plans]) for m in rows_m]))
            rows = [{"m": m, "cublas_s": cublas[m], "candidates": time_plans(dg, timer, w, xs[m], plans, refs[m])}
                    for m in rows_m]
            bad = sum(1 for r in rows for c in r["candidates"] if c.get("ok") is False)
            entry = {"model": model, "layer": layer, "n": n, "k": k, "weight_read_limit_s": limit_s,
                     "stage1": ranked, "rows": rows}
            result["shapes"].append(entry)
            choice = choose(rows, args.margin)
            best1 = min((c["s"] for c in rows[0]["candidates"] if c.get("ok")), default=float("nan"))
            line = (f"{model:14s} {layer:12s} {n:6d} x {k:5d}: cuBLAS "
                    f"{'/'.join(f'{cublas[m] * 1e6:.1f}' for m in rows_m)} us (M {'/'.join(map(str, rows_m))}); "
                    f"best GEMV at M=1 {best1 * 1e6:.1f} us; limit {limit_s * 1e6:.1f} us")
            if choice is not None:
                choice.update(model=model, layer=layer, n=n, k=k, weight_read_limit_s=limit_s)
                result["choices"].append(choice)
                line += (f"; chosen {choice['plan']} for M <= {choice['serve_m']}: {choice['us']} us, saves "
                         f"{choice['saved_us']} us over those M")
            else:
                line += "; cuBLAS stays"
            print(line + (f"; {bad} outputs differ from cuBLAS" if bad else "") + f" [{budget.elapsed():.0f} s]",
                  flush=True)
    finally:
        compiler.close()
    result["elapsed_s"] = budget.elapsed()
    return result


def fill_table(results_path: Path, table: Path = TABLE) -> list[str]:
    """Write ``table`` from a sweep's JSON (its choices: each served at the row counts where it
    beat cuBLAS by the sweep's margin). Returns the entries' lines."""
    data = json.loads(results_path.read_text())
    lines = []
    for c in data["choices"]:
        p = c["plan"]
        value = (c["serve_m"], p["block_n"], p["block_k"], p["split"], p["num_warps"], p["num_stages"],
                 p["fused_reduce"])
        lines.append(entry_line((data["sms"], c["n"], c["k"]), value,
                                f"{c['model']} {c['layer']}: {c['us']} us, cuBLAS {c['cublas_us']}"))
    write_table(table, results_path, data, lines, margin=data.get("margin", 0), bound=False,
                annotation="dict[tuple[int, int, int], tuple[int, int, int, int, int, int, bool]]")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser, what="the GEMV's table", table=TABLE, margin=0.05,
                    margin_help="the GEMV serves an M this much faster than cuBLAS", budget_s=50.0)
    parser.add_argument("--models", help="models of SHAPES to sweep, comma-separated (default: all)")
    parser.add_argument("--tiles-kept", type=int, default=3, help="tiles that go on to the split sweep")
    add_mode_args(parser)
    sweep_main(parser.parse_args(), fill_table, sweep)


if __name__ == "__main__":
    main()
