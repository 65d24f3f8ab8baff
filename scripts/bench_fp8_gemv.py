"""Sweep the FP8 weight-only GEMV's plans at 1-4 rows beside the W8A8 path and bf16, and fill its table.

For llama-8b's four projection shapes at M = 1..4 this times, each call replayed from a CUDA graph
with the L2 cold (``sweep_common.GraphTimer``):

- ``w8a8``: what FP8 layers ran before, the per-token activation quantizer then
  ``torch._scaled_mm`` (``fp8_triton.fp8_linear``);
- ``bf16_cublas``: ``torch.matmul`` on the same weights in bf16, and ``bf16_gemv``: the dense
  GEMV at its table's plan (its rule's where the table has none);
- the FP8 GEMV (``loom_plugins.quant.fp8_gemv``): its rule's plan, then candidates in two stages
  as ``bench_dense_gemv.py`` does (tiles ranked at one row at the rule's split count; the best
  ``--tiles-kept`` against every split count and merge at every M);

and the e4m3 weight's read limit (its bytes over the measured copy bandwidth). The choice per
shape (``bench_dense_gemv.choose`` with W8A8 as the time to beat; a shape where no plan beats it
gets an entry serving 0 rows, so that W8A8 keeps it) goes into the JSON;
``--fill-table`` writes it into ``plugins/quant/fp8_gemv_table.py``. Every candidate's output is
checked against the W8A16 reference ``x @ (codes * scale)^T`` (within 1% of the output's
largest magnitude); one that differs is reported and never chosen.

    PYTHONPATH=service:plugins/.. python scripts/bench_fp8_gemv.py --out fp8gemv.json [--budget-s 50]
    python scripts/bench_fp8_gemv.py --fill-table fp8gemv.json          # on any machine
    python scripts/bench_fp8_gemv.py --fill-table fp8gemv.json --table /tmp/loomsite/loom_plugins/quant/fp8_gemv_table.py
                                                                        # an installed copy, before a bench
    python scripts/bench_fp8_gemv.py --interpret                        # a CPU check of the script
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_dense_gemv import choose, fill_table, split_plans  # noqa: E402 (the same choice, table, stage 2)
from sweep_common import Budget, Compiler, GraphTimer, copy_bandwidth  # noqa: E402
from sweep_tables import add_common_args, add_mode_args, sweep_main  # noqa: E402

SHAPES = [("llama-8b", "qkv_proj", 6144, 4096), ("llama-8b", "o_proj", 4096, 4096),
          ("llama-8b", "gate_up_proj", 28672, 4096), ("llama-8b", "down_proj", 4096, 14336)]
ROWS = (1, 2, 3, 4)
# (block_n, block_k, num_warps, num_stages); the first is the rule's (fp8_gemv.default_plan)
TILES = [(64, 256, 4, 3), (64, 256, 4, 4), (128, 128, 4, 3), (128, 256, 8, 3), (64, 128, 4, 4), (32, 256, 4, 3),
         (64, 512, 4, 2), (128, 128, 8, 4), (256, 128, 8, 3)]
SPLITS = (1, 2, 4, 8, 16, 32)
TABLE = ROOT / "plugins" / "quant" / "fp8_gemv_table.py"


def _import() -> tuple[Any, Any, Any]:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.source_tree import make_importable

    make_importable()
    from loom.layers import dense_gemv
    from loom_plugins.quant import fp8_gemv, fp8_triton

    return dense_gemv, fp8_gemv, fp8_triton


def _operands(n: int, k: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes ``[n, k]`` and per-channel scales ``[n]`` of a random weight (std 0.02)."""
    gen = torch.Generator(device=device).manual_seed(n + k)
    w = torch.randn(n, k, generator=gen, device=device) * 0.02
    scale = (w.abs().amax(dim=1) / 448.0).clamp(min=1e-12)
    return (w / scale[:, None]).to(torch.float8_e4m3fn), scale.float().contiguous()


def _compile_task(task: tuple[int, int, list[int], list[dict[str, Any]]]) -> int:
    """Worker: run each plan once at each row count on the shape's own operands, so that its
    kernels are in Triton's cache for the timing process."""
    n, k, rows, plans = task
    dg, fg, _ = _import()
    device = torch.device("cuda")
    codes, scale = _operands(n, k, device, torch.bfloat16)
    done = 0
    for m in rows:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        for p in plans:
            try:
                fg.fp8_gemv(x, codes, scale, None, dg.GemvPlan(**p))
                done += 1
            except Exception:  # a plan the compiler refuses: the timing process reports it
                pass
    torch.cuda.synchronize()
    return done


def time_plans(fg: Any, timer: GraphTimer, codes: torch.Tensor, scale: torch.Tensor, x: torch.Tensor,
               plans: list[Any], ref: torch.Tensor) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    tol = 1e-2 * float(ref.abs().max()) + 1e-6
    for p in plans:
        try:
            s = timer(lambda p=p: fg.fp8_gemv(x, codes, scale, None, p))
            y = fg.fp8_gemv(x, codes, scale, None, p)
        except Exception as exc:  # a plan the compiler refuses
            found.append({"plan": asdict(p), "error": repr(exc)[:200]})
            continue
        found.append({"plan": asdict(p), "s": s, "ok": bool((y.float() - ref).abs().max() <= tol)})
    return found


def us(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e6:.1f}"


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    dg, fg, ft = _import()
    interpret = args.interpret
    device = torch.device("cpu" if interpret else "cuda")
    dtype = torch.float32 if interpret else torch.bfloat16
    budget = Budget(args.budget_s)
    shapes: list[tuple[str, str, int, int]]
    rows_m: tuple[int, ...]
    tiles: list[tuple[int, int, int, int]]
    splits: tuple[int, ...]
    if interpret:
        shapes, rows_m, sms = [("tiny", "a", 48, 96), ("tiny", "b", 20, 200)], (1, 2), 8
        tiles, splits = [(16, 32, 4, 2), (32, 64, 4, 2)], (1, 2)
    else:
        shapes, rows_m, tiles, splits = SHAPES, ROWS, TILES, SPLITS
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    compiler = Compiler(1 if interpret else args.jobs)
    timer = GraphTimer(device, cold=not args.warm)
    bandwidth = copy_bandwidth(device)
    result: dict[str, Any] = {"sms": sms, "cold_l2": not args.warm, "copy_bytes_per_s": bandwidth,
                              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "margin": args.margin, "baseline": "w8a8", "shapes": [], "choices": []}

    def rule_split(n: int, k: int, bn: int, bk: int) -> int:
        from loom.layers.split_k import split_k

        return int(split_k(-(-n // bn), k, bk, 4 * sms, 16)[0])

    def stage1_plans(n: int, k: int) -> list[Any]:
        plans = [fg.default_plan(n, k, sms)]
        for bn, bk, w, st in tiles:
            s = rule_split(n, k, bn, bk)
            plans.append(dg.GemvPlan(bn, bk, s, w, st, s > 1))
        return list(dict.fromkeys(plans))

    pending = {(n, k): compiler.submit(_compile_task, [(n, k, [1], [asdict(p) for p in stage1_plans(n, k)])])
               for _, _, n, k in shapes}
    try:
        for model, layer, n, k in shapes:
            if budget.spent():
                print(f"budget of {args.budget_s:.0f} s spent: stopping", flush=True)
                break
            compiler.wait(pending[(n, k)])
            codes, scale = _operands(n, k, device, dtype)
            w_deq = (codes.float() * scale[:, None]).to(dtype)  # the bf16 layer of the same weights
            gen = torch.Generator(device=device).manual_seed(7)
            xs = {m: torch.randn(m, k, generator=gen, device=device).to(dtype) for m in rows_m}
            refs = {m: xs[m].float() @ (codes.float() * scale[:, None]).t() for m in rows_m}  # W8A16
            limit_s = n * k / bandwidth  # one byte a weight
            base: dict[int, float] = {}
            extra: dict[str, dict[int, float]] = {"bf16_cublas": {}, "bf16_gemv": {}}
            if interpret:
                for m in rows_m:
                    base[m] = timer(lambda x=xs[m], w=w_deq: x @ w.t())
            else:
                layer_state = ft.FP8GpuWeights(weight=codes, scale_row=scale.view(1, -1), scale_scalar=None,
                                               input_scale=None, rowwise=ft.rowwise_supported(device.index or 0, dtype),
                                               out_dtype=dtype)
                bf16_plan = dg.table_plan(n, k, 1, sms) or dg.default_plan(n, k, sms)
                for m in rows_m:
                    base[m] = timer(lambda x=xs[m], st=layer_state: ft.fp8_linear(x, st, None))
                    extra["bf16_cublas"][m] = timer(lambda x=xs[m], w=w_deq: torch.matmul(x, w.t()))
                    extra["bf16_gemv"][m] = timer(
                        lambda x=xs[m], w=w_deq, p=bf16_plan: dg.dense_gemv(x, w, None, p))
            rule = fg.default_plan(n, k, sms)
            ranked = sorted((r for r in time_plans(fg, timer, codes, scale, xs[1], stage1_plans(n, k), refs[1])
                             if r.get("ok")), key=lambda r: r["s"])
            plans = split_plans(dg, ranked[: args.tiles_kept], splits, k)
            plans = list(dict.fromkeys([rule, *plans]))
            compiler.wait(compiler.submit(_compile_task, [(n, k, [m], [asdict(p) for p in plans]) for m in rows_m]))
            rows: list[dict[str, Any]] = [{"m": m, "cublas_s": base[m], "w8a8_s": base[m],
                     **{f"{key}_s": t[m] for key, t in extra.items() if m in t},
                     "candidates": time_plans(fg, timer, codes, scale, xs[m], plans, refs[m])} for m in rows_m]
            for r in rows:
                rule_c = next((c for c in r["candidates"] if c.get("ok") and c["plan"] == asdict(rule)), None)
                r["rule_s"] = rule_c["s"] if rule_c else None
            bad = sum(1 for r in rows for c in r["candidates"] if c.get("ok") is False)
            result["shapes"].append({"model": model, "layer": layer, "n": n, "k": k, "weight_read_limit_s": limit_s,
                                     "stage1": ranked, "rows": rows})
            choice = choose(rows, args.margin)
            line = (f"{model} {layer:12s} {n:6d} x {k:5d} (M {'/'.join(map(str, rows_m))}): W8A8 "
                    f"{'/'.join(us(base[m]) for m in rows_m)} us; FP8 GEMV rule "
                    f"{'/'.join(us(r['rule_s']) for r in rows)}; bf16 cuBLAS "
                    f"{'/'.join(us(extra['bf16_cublas'].get(m)) for m in rows_m)}; bf16 GEMV "
                    f"{'/'.join(us(extra['bf16_gemv'].get(m)) for m in rows_m)}; e4m3 limit {us(limit_s)}")
            if choice is None:  # slower than W8A8 even at one row: a table entry serving no rows keeps W8A8
                choice = {"plan": asdict(rule), "serve_m": 0, "saved_us": 0.0, "us": {},
                          "cublas_us": {str(m): round(base[m] * 1e6, 2) for m in rows_m}}
            choice.update(model=model, layer=layer, n=n, k=k, weight_read_limit_s=limit_s)
            result["choices"].append(choice)
            line += f"; best {choice['plan']} for M <= {choice['serve_m']}: {choice['us']} us"
            print(line + (f"; {bad} outputs differ from the reference" if bad else "") + f" [{budget.elapsed():.0f} s]",
                  flush=True)
    finally:
        compiler.close()
    result["elapsed_s"] = budget.elapsed()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser, what="the FP8 GEMV's table", table=TABLE, margin=0.05,
                    margin_help="the GEMV serves an M this much faster than W8A8", budget_s=50.0)
    parser.add_argument("--tiles-kept", type=int, default=2, help="tiles that go on to the split sweep")
    add_mode_args(parser)
    sweep_main(parser.parse_args(), fill_table, sweep)


if __name__ == "__main__":
    main()
