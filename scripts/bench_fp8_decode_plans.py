"""Sweep the FP8 kernel's decode launches (``_paged_attn_fp8_kernel``) and fill its plan table.

Issue #20: at batch 256, 512-token contexts, llama-8b's layout, the kernel reads its 276 MB of
codes and scales a layer in 101 us on the H200 (2.7 TB/s, ~61% of the copy rate), with today's
launch: one warp a (sequence, KV head) program, 8 query rows, 64-key tiles, Triton's default
stages, the split count of ``decode_plans.choose_num_splits``. This times, each call replayed from
a CUDA graph with the L2 cold (``sweep_common.GraphTimer``), the launch of every candidate --
key tile ``block_n`` (32-256: whole 16-token pages, each warp still owning whole MMA tiles of 16
keys), ``num_warps`` (1 / 2 / 4), ``num_stages`` (1-3), a cap on registers a thread (``maxnreg``),
the block-table prefetch that double-buffers K/V, and split count (1-16) -- beside
today's, for llama-8b's layout (8 KV heads of 4 query heads, head 128) and Qwen3-30B-A3B's (4, 8)
at batch 1, 4, 16, 64, 128, 256 and contexts 512, 1024, 2048 (the rule's split count taken, as in
a CUDA graph, from the graph's bound ``--bound``).

Two stages, to fit ``--budget-s``: the tiles (block_n, warps, stages) are ranked at every batch
on one context at the rule's split count; the best ``--tiles-kept`` of each batch then meet every
split count on every context. Per (layout, batch) the launch with the lowest geometric mean over
the contexts of its time over the best time at that context is the choice; ``--fill-table``
writes the choices that beat the rule by ``--margin`` into
``plugins/attention/fp8_decode_plan_table.py`` (an empty table keeps the rule).

    PYTHONPATH=service:plugins/.. python scripts/bench_fp8_decode_plans.py --out fp8.json [--budget-s 80]
    python scripts/bench_fp8_decode_plans.py --fill-table fp8.json       # on any machine
    python scripts/bench_fp8_decode_plans.py --interpret                 # a CPU check of the script

Bandwidth is counted as ``scripts/bench_paged_attention.py`` counts it: the K/V codes and scales
read, over the time (reported beside the copy rate, read plus written, of a 1 GiB copy). Every
candidate's output is compared with the rule's (bf16: within 2e-2); one that differs is reported
and never chosen.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_decode_plans  # noqa: E402 (the same choice)
from sweep_common import Budget, Compiler, GraphTimer, copy_bandwidth  # noqa: E402
from sweep_tables import add_common_args, add_decode_args, add_mode_args, fill_rule_table, sweep_main  # noqa: E402

# (name, KV heads, query heads per KV head, head size)
LAYOUTS = [("llama-8b", 8, 4, 128), ("qwen3-30b-a3b", 4, 8, 128)]
BATCHES = (1, 4, 16, 64, 128, 256)
CONTEXTS = (512, 1024, 2048)
SPLITS = (1, 2, 4, 8, 16)
# (block_n, num_warps, num_stages, max_registers, prefetch_table); None: the launcher's / Triton's /
# ptxas's choice (the first is the rule's tile). Why these (scripts/paged_sass.py --fp8-plans, sm_90): today's tile
# keeps K/V in one shared buffer (20 KB a program: 11 programs a SM) at 167 registers (12); 32-key
# tiles need 11 KB (19 a SM) and capped at 128 registers spill 8 bytes, so 16 one-warp programs
# stay resident a SM: batch 256 x 8 KV heads (2,048 programs) in one wave of 132 x 16 instead of
# 1.4 waves of 132 x 11. The block-table prefetch double-buffers K/V (36 KB a program at 64 keys:
# 6 a SM; 19 KB at 32 keys: 11 a SM): fewer resident warps, each with a tile in flight while it
# computes the last.
Tile = tuple[int | None, int | None, int | None, int | None, bool]
TILES: list[Tile] = [(None, None, None, None, False), (64, 1, 2, None, False), (64, 1, 1, None, False),
                     (32, 1, 2, None, False), (32, 1, 3, None, False), (32, 1, 2, 128, False), (32, 1, 3, 128, False),
                     (128, 1, 2, None, False), (64, 2, 2, None, False), (128, 2, 2, None, False),
                     (128, 2, 3, None, False), (128, 4, 2, None, False), (128, 4, 3, None, False),
                     (256, 4, 2, None, False), (64, 1, 3, None, True), (32, 1, 3, 128, True), (32, 1, 3, None, True)]
TILE_CTX = 1024  # the context the tiles are ranked at
PAGE = 16
# PLANS' type, as the table module declares it
ANNOTATION = "dict[tuple[int, int, int, int, int], tuple[int, int | None, int | None, int | None, int | None, bool]]"
TABLE = ROOT / "plugins" / "attention" / "fp8_decode_plan_table.py"


def _import() -> tuple[Any, Any, Any]:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.source_tree import make_importable

    make_importable()
    from loom.layers import kv_fp8
    from loom_plugins.attention import decode_plans, triton_fp8_attention

    return decode_plans, triton_fp8_attention, kv_fp8


@dataclass(frozen=True)
class Layout:
    name: str
    hkv: int
    group: int
    head_dim: int


@dataclass(frozen=True)
class Fp8Plan:
    num_splits: int
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    max_registers: int | None = None
    prefetch_table: bool = False


class Pool:
    """One layout's packed FP8 pool of ``max_batch`` sequences of ``max_ctx`` keys (quantized
    from normal values, a chunk of blocks at a time), its pages shuffled; a case takes the first
    ``batch`` sequences' first ``ctx`` keys, its block tables as wide as the graph's bound
    (stale zeros past each sequence)."""

    def __init__(self, layout: Layout, max_batch: int, max_ctx: int, bound: int, device: torch.device,
                 dtype: torch.dtype, kv_fp8: Any) -> None:
        gen = torch.Generator(device=device).manual_seed(0)
        self.layout, self.bound, self.device, self.dtype = layout, bound, device, dtype
        self.per_seq = -(-max_ctx // PAGE)
        blocks = max_batch * self.per_seq + 1
        self.kv = kv_fp8.allocate(blocks, PAGE, layout.hkv, layout.head_dim, device)
        views = kv_fp8.views(self.kv)
        chunk = 2048
        for b0 in range(0, blocks, chunk):
            b1 = min(blocks, b0 + chunk)
            x = torch.randn(2, b1 - b0, PAGE, layout.hkv, layout.head_dim, generator=gen, device=device)
            c, s = kv_fp8.quantize(x)
            views.k_codes[b0:b1].copy_(c[0])
            views.v_codes[b0:b1].copy_(c[1])
            views.k_scales[b0:b1].copy_(s[0])
            views.v_scales[b0:b1].copy_(s[1])
        perm = torch.randperm(blocks, generator=torch.Generator().manual_seed(1))[: max_batch * self.per_seq]
        self.pages = perm.to(torch.int32).view(max_batch, self.per_seq)

    def case(self, batch: int, ctx: int, seed: int) -> Case:
        return Case(self, batch, ctx, seed)


class Case:
    """One decode launch's inputs over a :class:`Pool`."""

    def __init__(self, pool: Pool, batch: int, ctx: int, seed: int) -> None:
        lay, dev = pool.layout, pool.device
        gen = torch.Generator(device=dev).manual_seed(seed)
        self.layout, self.batch, self.ctx, self.kv = lay, batch, ctx, pool.kv
        per_seq = -(-ctx // PAGE)
        table = torch.zeros(batch, pool.bound // PAGE, dtype=torch.int32)
        table[:, :per_seq] = pool.pages[:batch, :per_seq]
        self.block_tables = table.to(dev)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        self.qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev)
        hq = lay.hkv * lay.group
        self.q = torch.randn(batch, hq, lay.head_dim, generator=gen, device=dev).to(pool.dtype)
        self.out = torch.empty_like(self.q)

    def kv_bytes(self) -> int:
        """Bytes the launch moves, counted as ``scripts/bench_paged_attention.py`` counts them: the
        codes and scales read (D + 4 bytes a key, KV head and each of K, V), the query and
        output (2 bytes an element each) and the block tables."""
        lay = self.layout
        kv = 2 * self.batch * self.ctx * lay.hkv * (lay.head_dim + 4)
        return kv + 2 * self.batch * lay.hkv * lay.group * lay.head_dim * 2 + self.block_tables.numel() * 4


def run(f8: Any, case: Case, plan: Fp8Plan) -> None:
    f8.paged_attention_fp8(case.q, case.kv, case.out, case.qsl, case.seq_lens, case.block_tables,
                           num_seqs=case.batch, seq_ids=None, max_query_len=1, scale=case.layout.head_dim**-0.5,
                           sliding_window=None, num_splits=plan.num_splits, block_n=plan.block_n,
                           num_warps=plan.num_warps, num_stages=plan.num_stages, max_registers=plan.max_registers,
                           prefetch_table=plan.prefetch_table)


def _compile_task(task: tuple[tuple[str, int, int, int], list[dict[str, Any]], int]) -> int:
    """Worker: launch each plan once on a small case of the layout (same specialisation as the
    sweep's cases), so that its kernels are in Triton's cache."""
    layout_t, plans, bound = task
    _, f8, kv_fp8 = _import()
    device = torch.device("cuda")
    pool = Pool(Layout(*layout_t), 1, 64, bound, device, torch.bfloat16, kv_fp8)
    case = pool.case(1, 64, 0)
    n = 0
    for p in plans:
        try:
            run(f8, case, Fp8Plan(**p))
            n += 1
        except Exception:  # a plan the compiler refuses: the timing process reports it
            pass
    torch.cuda.synchronize()
    return n


def _chunks(layout: Layout, plans: list[Fp8Plan], bound: int, jobs: int) -> list[Any]:
    per = max(1, -(-len(plans) // max(1, 2 * jobs)))
    lt = (layout.name, layout.hkv, layout.group, layout.head_dim)
    return [(lt, [asdict(p) for p in plans[i:i + per]], bound) for i in range(0, len(plans), per)]


def choose(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """``bench_decode_plans.choose`` (the lowest geometric mean over the contexts of a plan's time
    over the best), with the chosen plan's TB/s at each context."""
    choice = bench_decode_plans.choose(rows)
    if choice is None:
        return None
    chosen = {r["ctx"]: next(c["s"] for c in r["candidates"] if c.get("ok") and c["plan"] == choice["plan"])
              for r in rows}
    choice["tb_s"] = {str(r["ctx"]): round(r["kv_bytes"] / chosen[r["ctx"]] / 1e12, 3) for r in rows}
    return choice


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    dp, f8, kv_fp8 = _import()
    device = torch.device("cpu" if args.interpret else "cuda")
    dtype = torch.float16 if args.interpret else torch.bfloat16
    budget = Budget(args.budget_s)
    tiles: list[Tile]
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    splits: tuple[int, ...]
    if args.interpret:  # the interpreter ignores warps and stages: the tiles differ by block_n only
        layouts = [Layout("tiny", 2, 4, 32)]
        batches, contexts, bound, sms = (1, 3), (40, 100), 128, 8
        tiles, tile_ctx, splits = [(None, None, None, None, False), (32, 2, 2, 128, True)], 100, (1, 2)
    else:
        wanted = set(args.layouts.split(",")) if args.layouts else None
        layouts = [Layout(*lt) for lt in LAYOUTS if wanted is None or lt[0] in wanted]
        batches = tuple(int(b) for b in args.batches.split(","))
        contexts = tuple(int(c) for c in args.contexts.split(","))
        bound, tiles, tile_ctx, splits = args.bound, TILES, TILE_CTX, SPLITS
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    compiler = Compiler(1 if args.interpret else args.jobs)
    timer = GraphTimer(device, cold=not args.warm)
    tol = 5e-3 if dtype == torch.float16 else 2e-2
    result: dict[str, Any] = {"sms": sms, "bound": bound, "cold_l2": not args.warm,
                              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "copy_bytes_per_s": copy_bandwidth(device), "flush_s": timer.flush_s,
                              "tiles": {}, "cases": [], "choices": []}

    def rule_of(layout: Layout, batch: int) -> Fp8Plan:
        return Fp8Plan(dp.choose_num_splits(batch, layout.hkv, bound, sms))

    def time_plans(case: Case, plans: list[Fp8Plan], ref: torch.Tensor) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for p in plans:
            try:
                s = timer(lambda p=p: run(f8, case, p))
            except Exception as exc:  # a plan the compiler refuses (shared memory, registers)
                rows.append({"plan": asdict(p), "error": repr(exc)[:200]})
                continue
            ok = torch.allclose(case.out.float(), ref, atol=tol, rtol=tol)
            rows.append({"plan": asdict(p), "s": s, "ok": bool(ok),
                         "tb_s": round(case.kv_bytes() / max(s, 1e-12) / 1e12, 3)})
        return rows

    def stage2_plans(rule: Fp8Plan, kept: list[Tile]) -> list[Fp8Plan]:
        return list(dict.fromkeys([rule] + [Fp8Plan(s, *t) for t in kept for s in splits]))

    # Every candidate's kernels compile in the background from the start (NUM_SPLITS is a
    # constexpr: each tile at each split count is a variant).
    every = {lay.name: list(dict.fromkeys(Fp8Plan(s, *t) for t in tiles
                                          for s in {*splits, *(rule_of(lay, b).num_splits for b in batches)}))
             for lay in layouts}
    pending = {lay.name: compiler.submit(_compile_task, _chunks(lay, every[lay.name], bound, args.jobs))
               for lay in layouts}
    try:
        for layout in layouts:
            if budget.spent():
                break
            n, failed = compiler.wait(pending[layout.name])
            print(f"{layout.name}: {n} variants compiled ahead ({failed} tasks failed) [{budget.elapsed():.0f} s]",
                  flush=True)
            pool = Pool(layout, max(batches), max(contexts), bound, device, dtype, kv_fp8)
            result["tiles"][layout.name] = {}
            for batch in batches:
                if budget.spent():
                    print(f"budget of {args.budget_s:.0f} s spent: stopping", flush=True)
                    break
                rule = rule_of(layout, batch)
                # Stage 1: the tiles at the rule's split count, on one context.
                case = pool.case(batch, tile_ctx, seed=batch)
                run(f8, case, rule)
                ref = case.out.float().clone()
                t_rows = time_plans(case, [Fp8Plan(rule.num_splits, *t) for t in tiles], ref)
                score = {t: r["s"] if r.get("ok") else float("inf") for t, r in zip(tiles, t_rows, strict=True)}
                kept = sorted(tiles, key=lambda t: score[t])[: 1 if args.interpret else args.tiles_kept]
                result["tiles"][layout.name][str(batch)] = t_rows
                # Stage 2: every split count with the kept tiles, at every context.
                rows = []
                for ctx in contexts:
                    case = pool.case(batch, ctx, seed=ctx + batch)
                    run(f8, case, rule)
                    ref = case.out.float().clone()
                    row: dict[str, Any] = {"layout": layout.name, "hkv": layout.hkv, "group": layout.group,
                                           "head_dim": layout.head_dim, "batch": batch, "ctx": ctx,
                                           "kv_bytes": case.kv_bytes(), "rule": asdict(rule),
                                           "candidates": time_plans(case, stage2_plans(rule, kept), ref)}
                    bad = [c["plan"] for c in row["candidates"] if c.get("ok") is False]
                    if bad:
                        print(f"  {layout.name} b{batch} ctx {ctx}: {len(bad)} plans differ from the rule: {bad[:3]}")
                    rows.append(row)
                    result["cases"].append(row)
                choice = choose(rows)
                if choice is None:
                    continue
                choice.update(layout=layout.name, hkv=layout.hkv, group=layout.group, head_dim=layout.head_dim,
                              batch=batch, rule=asdict(rule))
                result["choices"].append(choice)
                print(f"{layout.name:14s} b{batch:<3d}: best {choice['plan']} {choice['speedup_vs_rule']:.2f}x the "
                      f"rule ({rule.num_splits} splits); us by context {choice['us']} vs the rule's "
                      f"{choice['rule_us']}; TB/s {choice['tb_s']} [{budget.elapsed():.0f} s]", flush=True)
            del pool
    finally:
        compiler.close()
    result["elapsed_s"] = budget.elapsed()
    return result


def fill_table(results_path: Path, margin: float, table: Path = TABLE) -> list[str]:
    """Write ``table`` from a sweep's JSON: the choices at least ``1 + margin`` times faster than
    the rule (geometric mean over the contexts). Returns the entries' lines."""
    return fill_rule_table(results_path, margin, table, ANNOTATION,
                           lambda p: (p["num_splits"], p["block_n"], p["num_warps"], p["num_stages"], p["max_registers"],
                                      p["prefetch_table"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser, what="the FP8 plan table", table=TABLE, margin=0.03,
                    margin_help="a choice enters the table this much faster", budget_s=80.0)
    add_decode_args(parser, batches=BATCHES, contexts=CONTEXTS)
    parser.add_argument("--tiles-kept", type=int, default=3, help="tiles of each batch that meet every split count")
    add_mode_args(parser)
    args = parser.parse_args()
    sweep_main(args, lambda results, table: fill_table(results, args.margin, table), sweep)


if __name__ == "__main__":
    main()
