"""Sweep the paged attention's decode plans at batch 1-16 and fill the planner's table from it.

On the H200 a batch-1 decode step spends 6.5-6.8 us a layer in ``_paged_attn_kernel`` plus
1.6-1.9 us in ``_combine_kernel`` for 1-2 MB of K/V (bench/results/profile-random-*-b1.txt):
latency, not bytes. This times the decode launch (``paged_attention``, split merge included) of
each candidate plan (``decode_plans.DecodePlan``: split count, min keys a split, key tile, warps,
stages, merged by a second launch or by the last split) for four head layouts -- (KV heads, query
heads each, head size) (4, 8, 128) Qwen3-30B-A3B, (8, 4, 128) llama-8b, (3, 3, 64) SmolLM2,
(8, 1, 128) -- at batch 1, 2, 4, 8, 16 and contexts 128-4096, beside the rule used today (its
split count taken, as in a CUDA graph, from the graph's bound ``--bound``, 4096 by default),
each call replayed from a CUDA graph with the L2 cold (``sweep_common.GraphTimer``).

Two stages, to fit about a minute: the key tiles (block_n, warps, stages) are ranked first on
three cases of each layout at the rule's split count; the best ``--tiles-kept`` then meet every
split count, min_keys and merge on every (batch, context). Per (layout, batch) the plan with the
lowest geometric mean over the contexts of its time over the best time at that context is the
choice; ``--fill-table`` writes the choices that beat the rule by ``--margin`` into
``plugins/attention/decode_plan_table.py``.

    PYTHONPATH=service:plugins/.. python scripts/bench_decode_plans.py --out decode.json [--budget-s 50]
    python scripts/bench_decode_plans.py --fill-table decode.json       # on any machine
    python scripts/bench_decode_plans.py --interpret                    # a CPU check of the script

Every candidate's output is compared with the rule's (bf16: within 2e-2); one that differs is
reported and never chosen.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from sweep_common import Budget, Compiler, GraphTimer, geomean  # noqa: E402
from sweep_tables import add_common_args, add_decode_args, add_mode_args, fill_rule_table, sweep_main  # noqa: E402

# (name, KV heads, query heads per KV head, head size)
LAYOUTS = [("qwen3-30b-a3b", 4, 8, 128), ("llama-8b", 8, 4, 128), ("smollm2", 3, 3, 64), ("mha-8x128", 8, 1, 128)]
BATCHES = (1, 2, 4, 8, 16)
CONTEXTS = (128, 512, 1024, 2048, 4096)
SPLITS = (2, 4, 8, 16, 32)
MIN_KEYS = (0, 128, 256)
# (block_n, num_warps, num_stages); None: the launcher's / Triton's default (the rule's tile)
Tile = tuple[int | None, int | None, int | None]
TILES: list[Tile] = [(None, None, None), (64, 4, 1), (64, 4, 2), (64, 8, 2), (128, 4, 2), (128, 8, 2), (32, 4, 2), (32, 2, 2),
         (32, 2, 1), (16, 2, 2), (16, 1, 2), (16, 1, 1)]
TILE_CASES = ((1, 512), (1, 4096), (8, 2048))  # (batch, context) the tiles are ranked on
PAGE = 16
# PLANS' type, as the table module declares it
ANNOTATION = "dict[tuple[int, int, int, int, int], tuple[int, int, int | None, int | None, int | None, bool]]"
TABLE = ROOT / "plugins" / "attention" / "decode_plan_table.py"


def _import() -> tuple[Any, Any, Any]:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.source_tree import make_importable

    make_importable()
    from loom.layers import split_k
    from loom_plugins.attention import decode_plans, triton_kernels

    return decode_plans, triton_kernels, split_k


@dataclass(frozen=True)
class Layout:
    name: str
    hkv: int
    group: int
    head_dim: int


class Case:
    """One decode launch's inputs: ``batch`` sequences of ``ctx`` keys each in a bf16 pool,
    shuffled block tables as wide as the graph's bound (stale zeros past each sequence)."""

    def __init__(self, layout: Layout, batch: int, ctx: int, bound: int, device: torch.device, dtype: torch.dtype,
                 seed: int = 0) -> None:
        gen = torch.Generator(device=device).manual_seed(seed)  # drawn on the device: pools of 100s of MB
        self.layout, self.batch, self.ctx = layout, batch, ctx
        hq = layout.hkv * layout.group
        per_seq = -(-ctx // PAGE)
        blocks = batch * per_seq + 1
        self.kv = torch.randn(2, blocks, PAGE, layout.hkv, layout.head_dim, generator=gen, device=device).to(dtype)
        table = torch.zeros(batch, bound // PAGE, dtype=torch.int32)
        perm = torch.randperm(blocks, generator=torch.Generator().manual_seed(seed))[: batch * per_seq]
        table[:, :per_seq] = perm.to(torch.int32).view(batch, per_seq)
        self.block_tables = table.to(device)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        self.qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
        self.q = torch.randn(batch, hq, layout.head_dim, generator=gen, device=device).to(dtype)
        self.out = torch.empty_like(self.q)


def run(tk: Any, case: Case, plan: Any, counters: torch.Tensor | None) -> None:
    tk.paged_attention(case.q, case.kv, case.out, case.qsl, case.seq_lens, case.block_tables, num_seqs=case.batch,
                       seq_ids=None, max_query_len=1, scale=case.layout.head_dim**-0.5, sliding_window=None,
                       num_splits=plan.num_splits, block_n=plan.block_n, num_warps=plan.num_warps,
                       num_stages=plan.num_stages, min_keys=plan.min_keys,
                       counters=counters if plan.fused_combine else None)


def stage2_plans(dp: Any, tiles: list[Tile], rule: Any, splits: tuple[int, ...] = SPLITS,
                 min_keys: tuple[int, ...] = MIN_KEYS) -> list[Any]:
    """The rule, then every kept tile unsplit and at every split count, min_keys and merge."""
    plans = [rule]
    for bn, warps, stages in tiles:
        plans.append(dp.DecodePlan(1, 0, bn, warps, stages, False))
        for s, mk, fused in itertools.product(splits, min_keys, (False, True)):
            plans.append(dp.DecodePlan(s, mk, bn, warps, stages, fused))
    return list(dict.fromkeys(plans))


def _compile_task(task: tuple[tuple[str, int, int, int], list[dict[str, Any]], int]) -> int:
    """Worker: launch each plan once on a small case of the layout (same specialisation as the
    sweep's cases), so that its kernels are in Triton's cache."""
    layout_t, plans, bound = task
    dp, tk, sk = _import()
    device = torch.device("cuda")
    case = Case(Layout(*layout_t), 1, 64, bound, device, torch.bfloat16)
    ctr = sk.counters(device)
    n = 0
    for p in plans:
        try:
            run(tk, case, dp.DecodePlan(**p), ctr)
            n += 1
        except Exception:  # a plan the compiler refuses: the timing process reports it
            pass
    torch.cuda.synchronize()
    return n


def _chunks(layout: Layout, plans: list[Any], bound: int, jobs: int) -> list[Any]:
    per = max(1, -(-len(plans) // max(1, jobs)))
    lt = (layout.name, layout.hkv, layout.group, layout.head_dim)
    return [(lt, [asdict(p) for p in plans[i:i + per]], bound) for i in range(0, len(plans), per)]


def choose(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The plan with the lowest geometric mean, over the contexts, of its time over the best time
    at that context, among plans timed (and matching the rule) at every context of ``rows``."""
    contexts = [r["ctx"] for r in rows]
    best_at = {r["ctx"]: min(c["s"] for c in r["candidates"] if c.get("ok")) for r in rows}
    times: dict[str, dict[int, float]] = {}
    plans: dict[str, dict[str, Any]] = {}
    for r in rows:
        for c in r["candidates"]:
            if c.get("ok"):
                key = json.dumps(c["plan"], sort_keys=True)
                times.setdefault(key, {})[r["ctx"]] = c["s"]
                plans[key] = c["plan"]
    full = {k: v for k, v in times.items() if len(v) == len(contexts)}
    if not full:
        return None
    scored = {k: geomean([v[c] / best_at[c] for c in contexts]) for k, v in full.items()}
    key = min(scored, key=lambda k: (scored[k], sum(full[k].values())))
    rule_key = json.dumps(rows[0]["rule"], sort_keys=True)
    rule_score = scored.get(rule_key, float("nan"))
    return {"plan": plans[key], "score": scored[key], "rule_score": rule_score,
            "speedup_vs_rule": geomean([full[rule_key][c] / full[key][c] for c in contexts]) if rule_key in full
            else float("nan"),
            "us": {str(c): round(full[key][c] * 1e6, 2) for c in contexts},
            "rule_us": {str(c): round(full[rule_key][c] * 1e6, 2) for c in contexts} if rule_key in full else {}}


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    dp, tk, sk = _import()
    device = torch.device("cpu" if args.interpret else "cuda")
    dtype = torch.float32 if args.interpret else torch.bfloat16
    budget = Budget(args.budget_s)
    tiles: list[Tile]
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    splits: tuple[int, ...]
    min_keys: tuple[int, ...]
    tile_cases: tuple[tuple[int, int], ...]
    if args.interpret:
        layouts = [Layout("tiny", 2, 4, 32)]
        batches, contexts, bound, tiles, sms = (2,), (40, 100), 128, [(None, None, None), (16, None, None)], 8
        tile_cases, splits, min_keys = ((1, 100),), (4,), (0, 32)
    else:
        wanted = set(args.layouts.split(",")) if args.layouts else None
        layouts = [Layout(*lt) for lt in LAYOUTS if wanted is None or lt[0] in wanted]
        batches = tuple(int(b) for b in args.batches.split(","))
        contexts = tuple(int(c) for c in args.contexts.split(","))
        bound, tiles, tile_cases, splits, min_keys = args.bound, TILES, TILE_CASES, SPLITS, MIN_KEYS
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    compiler = Compiler(1 if args.interpret else args.jobs)
    timer = GraphTimer(device, cold=not args.warm)
    ctr = sk.counters(device)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    result: dict[str, Any] = {"sms": sms, "bound": bound, "cold_l2": not args.warm,
                              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "flush_s": timer.flush_s, "tiles": {}, "cases": [], "choices": []}

    def rule_of(layout: Layout, batch: int) -> Any:
        return dp.DecodePlan(dp.choose_num_splits(batch, layout.hkv, bound, sms))

    def time_plans(case: Case, plans: list[Any], ref: torch.Tensor) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for p in plans:
            try:
                s = timer(lambda p=p: run(tk, case, p, ctr))
            except Exception as exc:  # a plan the compiler refuses (shared memory, registers)
                rows.append({"plan": asdict(p), "error": repr(exc)[:200]})
                continue
            ok = torch.allclose(case.out.float(), ref, atol=tol, rtol=tol)
            rows.append({"plan": asdict(p), "s": s, "ok": bool(ok)})
        return rows

    def stage1_plans(layout: Layout) -> list[Any]:
        return list(dict.fromkeys(dp.DecodePlan(rule_of(layout, b).num_splits, 0, *t) for b, _ in tile_cases
                                  for t in tiles))

    # Every layout's tile variants compile in the background from the start.
    pending = {lay.name: compiler.submit(_compile_task, _chunks(lay, stage1_plans(lay), bound, args.jobs))
               for lay in layouts}
    try:
        for layout in layouts:
            if budget.spent():
                break
            n, failed = compiler.wait(pending[layout.name])
            print(f"{layout.name}: {n} tile variants compiled ahead ({failed} tasks failed) [{budget.elapsed():.0f} s]",
                  flush=True)
            # Stage 1: the tiles, at the rule's split count, on a few cases.
            scores: dict[Tile, list[float]] = {t: [] for t in tiles}
            for b, c in tile_cases:
                case = Case(layout, b, c, bound, device, dtype)
                run(tk, case, rule_of(layout, b), ctr)
                ref = case.out.float().clone()
                rows = time_plans(case, [dp.DecodePlan(rule_of(layout, b).num_splits, 0, *t) for t in tiles], ref)
                good = [r["s"] for r in rows if r.get("ok")] or [float("inf")]
                for t, r in zip(tiles, rows, strict=True):
                    scores[t].append(r["s"] / min(good) if r.get("ok") else float("inf"))
            ranked = sorted(tiles, key=lambda t: geomean(scores[t]))
            kept = ranked[: 1 if args.interpret else args.tiles_kept]
            result["tiles"][layout.name] = [{"tile": list(t), "score": geomean(scores[t])} for t in ranked]
            print(f"{layout.name}: tiles kept {kept} (scores {', '.join(f'{geomean(scores[t]):.3f}' for t in kept)}; "
                  f"the rule's {geomean(scores[tiles[0]]):.3f})", flush=True)
            # Stage 2: every split count, min_keys and merge with the kept tiles, at every case.
            union = list(dict.fromkeys(p for b in batches for p in stage2_plans(dp, kept, rule_of(layout, b), splits, min_keys)
                                       if p.min_keys == 0))  # min_keys is a run-time argument
            compiler.wait(compiler.submit(_compile_task, _chunks(layout, union, bound, args.jobs)))
            for batch in batches:
                rule = rule_of(layout, batch)
                plans = stage2_plans(dp, kept, rule, splits, min_keys)
                rows = []
                for ctx in contexts:
                    if budget.spent():
                        print(f"budget of {args.budget_s:.0f} s spent: stopping", flush=True)
                        break
                    case = Case(layout, batch, ctx, bound, device, dtype, seed=ctx + batch)
                    run(tk, case, rule, ctr)
                    ref = case.out.float().clone()
                    row: dict[str, Any] = {"layout": layout.name, "hkv": layout.hkv, "group": layout.group,
                           "head_dim": layout.head_dim, "batch": batch, "ctx": ctx, "rule": asdict(rule),
                           "candidates": time_plans(case, plans, ref)}
                    bad = [c["plan"] for c in row["candidates"] if c.get("ok") is False]
                    if bad:
                        print(f"  {layout.name} b{batch} ctx {ctx}: {len(bad)} plans differ from the rule: {bad[:3]}")
                    rows.append(row)
                    result["cases"].append(row)
                if len(rows) < len(contexts):
                    break
                choice = choose(rows)
                if choice is None:
                    continue
                choice.update(layout=layout.name, hkv=layout.hkv, group=layout.group, head_dim=layout.head_dim,
                              batch=batch, rule=asdict(rule))
                result["choices"].append(choice)
                print(f"{layout.name:14s} b{batch:<3d}: best {choice['plan']} {choice['speedup_vs_rule']:.2f}x the "
                      f"rule ({rule.num_splits} splits); us by context {choice['us']} vs the rule's "
                      f"{choice['rule_us']} [{budget.elapsed():.0f} s]", flush=True)
    finally:
        compiler.close()
    result["elapsed_s"] = budget.elapsed()
    return result


def fill_table(results_path: Path, margin: float, table: Path = TABLE) -> list[str]:
    """Write ``table`` from a sweep's JSON: the choices at least ``1 + margin`` times faster than
    the rule (geometric mean over the contexts). Returns the entries' lines."""
    return fill_rule_table(results_path, margin, table, ANNOTATION,
                           lambda p: (p["num_splits"], p["min_keys"], p["block_n"], p["num_warps"], p["num_stages"],
                                      p["fused_combine"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser, what="the planner's table", table=TABLE, margin=0.03,
                    margin_help="a choice enters the table this much faster", budget_s=50.0)
    add_decode_args(parser, batches=BATCHES, contexts=CONTEXTS)
    parser.add_argument("--tiles-kept", type=int, default=2, help="tiles that go on to the split sweep")
    add_mode_args(parser)
    args = parser.parse_args()
    sweep_main(args, lambda results, table: fill_table(results, args.margin, table), sweep)


if __name__ == "__main__":
    main()
