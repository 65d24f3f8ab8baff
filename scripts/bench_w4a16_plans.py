"""Sweep the W4A16 kernels' launch plans (plugins/quant/w4a16_triton.py) on llama-8b's layers.

On the H200 (2026-12-02) W1 with int4 weights ran at 163 out tok/s, 0.80x bf16 and 26% of the
int4 weight-read limit: the kernels, not the bytes, set the time. ``plan()`` picks tiles, warps,
stages and the K split from fixed rules written without a GPU; this script times every candidate
plan for each layer shape and token count M, each call replayed from a CUDA graph (as decode
steps run, so launch overhead is not counted), beside bf16 cuBLAS on the same shape and the
layer's weight-read limit (packed bytes over the measured copy bandwidth). It prints the best plan
against the current one (and, at one token, the current plan on the general GEMV beside the
integer-code one, ``_gemv_int_kernel``); ``--out`` writes all timings as JSON for
docs/quantization.md.

    PYTHONPATH=service:plugins/.. python scripts/bench_w4a16_plans.py [--quick] [--out FILE]

Needs a CUDA GPU with Triton (``--interpret`` runs a tiny shape through the same code with
TRITON_INTERPRET=1 on the CPU, to check the script itself).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def _import() -> tuple[Any, Any]:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.source_tree import make_importable

    make_importable()
    import helpers.quant_layers as ql

    from loom_plugins.quant import w4a16_triton as wt

    return ql, wt


def _time_graphed(fn: Any, device: torch.device, reps: int = 20, rounds: int = 5) -> float:
    """Seconds per call: ``reps`` calls captured in one CUDA graph, the best of ``rounds`` replays."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    best = float("inf")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):
        graph.replay()  # warm
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000 / reps)
    return best


def _copy_bandwidth(device: torch.device) -> float:
    """Bytes a second, read plus written, of a large device-to-device copy."""
    if device.type != "cuda":
        return 1e10
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    return 2 * a.numel() / _time_graphed(lambda: b.copy_(a), device, reps=5)


def _candidates(wt: Any, m: int, n: int, k: int, group: int, quick: bool, transposed_only: bool = False) -> list[Any]:
    bks = [b for b in (32, 64, 128) if group % b == 0 or b == 64]
    warps: list[int]
    stages: list[int]
    per_sm: list[int]
    if m == 1:
        shapes = [(1, bn) for bn in ((64, 128) if quick else (32, 64, 128, 256))]
        warps, stages, per_sm = [4, 8] if quick else [2, 4, 8], [2] if quick else [1, 2, 3, 4], [4, 8, 16, 32]
        kind = "gemv"
    else:
        # 256-row tiles from 256 tokens: each weight dequantized once a step instead of once per
        # 128-row tile (W2's GEMMs dequantize every weight twice with 128; docs/quantization.md)
        bms = [b for b in (16, 32, 64, 128, 256) if b <= max(16, 2 * m) and (b < 256 or m >= 256)]
        shapes = [(bm, bn) for bm in bms for bn in (64, 128)] if not quick else [(min(64, max(16, m)), 64)]
        if quick and m >= 256:
            shapes += [(128, 128), (256, 64), (256, 128)]
        warps, stages, per_sm = [4, 8], [2, 3, 4] if not quick else [3], [1, 2, 4]
        kind = "gemm"
    sms = wt.sm_count(torch.device("cuda")) if torch.cuda.is_available() else 8
    combos = [(kind, bm, bn, bk, w, s, target)
              for (bm, bn), bk, w, s, target in itertools.product(shapes, bks, warps, stages, per_sm)]
    if transposed_only and m > 1:
        combos = []
    if m > 1:  # the transposed GEMM (16-bit activations): tokens as the MMA's N, 64 or 128 weight rows
        rule = wt._gemm_t_plan(m, n, k, wt.block_k_for(group), sms)
        t_bms = [rule.block_m] if quick else sorted({max(16, rule.block_m // 2), rule.block_m})
        other_stages = 3 if rule.num_stages == 4 else 4
        for bm, bn, bk in itertools.product(t_bms, (64, 128), [b for b in (64, 128) if group % b == 0] or [64]):
            if bn == 64:  # (warps, stages, programs an SM): the rule's stages over four targets, and the others
                tries = [(4, rule.num_stages, t) for t in (1, 2, 4, 8)] + [(4, other_stages, 4)]
            else:
                tries = [(w, rule.num_stages, t) for w in (4, 8) for t in (2, 4)]
            combos += [("gemm_t", bm, bn, bk, w, s_, t) for w, s_, t in tries]
    plans = []
    for kind_, bm, bn, bk, w, s, target in combos:
        k_blocks = -(-k // bk)
        tiles = -(-n // bn) * -(-m // bm)
        split = 1
        while tiles * split < target * sms and split * 2 <= min(32, k_blocks):
            split *= 2
        k_split = -(-k_blocks // split) * bk
        split = -(-k // k_split)
        plans.append(wt.Plan(kind_, bm, bn, bk, split, k_split, w, s))
    return list(dict.fromkeys(plans))  # Plans are frozen dataclasses: drop repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the timings as JSON here")
    parser.add_argument("--quick", action="store_true", help="a few candidates a case")
    parser.add_argument("--tokens", default="1,4,16,64,256", help="token counts M")
    parser.add_argument("--schemes", default="gptq,awq,nf4", help="while-loading schemes to build layers with")
    parser.add_argument("--budget-s", type=float, default=400.0, help="stop sweeping after this long")
    parser.add_argument("--transposed-only", action="store_true",
                        help="from 2 tokens, sweep only the transposed GEMM's plans (the plain GEMM's rule is still timed)")
    parser.add_argument("--interpret", action="store_true", help="a tiny CPU check of the script (TRITON_INTERPRET=1)")
    args = parser.parse_args()
    if args.interpret:
        sys.path.insert(0, str(ROOT / "tests"))
        from helpers import triton_interpret

        triton_interpret.setup_script()
    ql, wt = _import()
    device = torch.device("cpu" if args.interpret else "cuda")
    dtype = torch.float32 if args.interpret else torch.bfloat16
    shapes = [("tiny", 256, [64, 32])] if args.interpret else ql.LLAMA_8B_SHAPES
    tokens = [1, 4] if args.interpret else [int(t) for t in args.tokens.split(",")]
    bandwidth = _copy_bandwidth(device)
    began = time.monotonic()
    results: list[dict[str, Any]] = []
    for scheme_name in args.schemes.split(","):
        scheme = ql.while_loading_scheme(scheme_name)
        for name, k, parts in shapes:
            if args.interpret:  # CPU layers are not repacked: a random layout of integer codes
                from helpers.quant_interpret_check import int_layout

                layout = int_layout(k, sum(parts), 64, 4, parts, False, dtype, seed=1)
            else:
                weights = ql.dense_parts(k, parts, seed=1)
                layer = ql.build_layer(scheme, k, parts, weights, device, dtype)
                layout = layer.w4a16 if "w4a16" in layer.__dict__ else None
            if layout is None:
                print(f"{scheme_name} {name}: no W4A16 layout on {device} (Triton missing?)")
                continue
            n = layout.out_features
            packed_bytes = sum(t.numel() * t.element_size() for t in (layout.qweight, layout.scales, layout.zeros)
                               if t is not None)
            dense = torch.randn(n, k, device=device, dtype=dtype) * 0.02
            for m in tokens:
                if time.monotonic() - began > args.budget_s:
                    print(f"budget of {args.budget_s:.0f} s spent: stopping")
                    break
                x = torch.randn(m, k, device=device, dtype=dtype)
                out = torch.empty(m, n, device=device, dtype=dtype)

                def run(p: Any, x: torch.Tensor = x, out: torch.Tensor = out, layout: Any = layout) -> None:
                    for seg in layout.segments:
                        wt._fused(x, layout, seg, None, out[:, seg.start:seg.end], p)

                ref_out = torch.empty(m, n, device=device, dtype=dtype)
                run(wt.plan(m, n, k, layout.group_size, wt.sm_count(device) if device.type == "cuda" else 8,
                            1 << 30, wt.uses_table(layout)))
                ref_out.copy_(out)
                current = wt.plan(m, n, k, layout.group_size, wt.sm_count(device) if device.type == "cuda" else 8,
                                  1 << 30, wt.uses_table(layout))
                timings = []
                for p in _candidates(wt, m, n, k, layout.group_size, args.quick or args.interpret, args.transposed_only):
                    try:
                        s = _time_graphed(lambda p=p: run(p), device)
                    except Exception as exc:  # a plan the compiler refuses (shared memory, registers)
                        timings.append({"plan": p.__dict__, "error": repr(exc)[:200]})
                        continue
                    ok = torch.allclose(out.float(), ref_out.float(), rtol=2e-2, atol=2e-2)
                    timings.append({"plan": p.__dict__, "s": s, "matches_current": ok})
                cur_s = _time_graphed(lambda c=current: run(c), device)
                general_s = None
                if m == 1 and wt.INT_GEMV and any(seg.table is None for seg in layout.segments):  # the same plan on the general GEMV, beside the integer-code one
                    wt.INT_GEMV = False
                    try:
                        general_s = _time_graphed(lambda c=current: run(c), device)
                    finally:
                        wt.INT_GEMV = True
                packed_s = float_tile_s = None
                if m > 1 and not args.interpret:  # the current plan with the 4-bit tile both ways (LOOM_W4A16_PACKED)
                    was = wt.PACKED
                    try:
                        wt.PACKED = True
                        packed_s = _time_graphed(lambda c=current: run(c), device)
                        wt.PACKED = False
                        float_tile_s = _time_graphed(lambda c=current: run(c), device)
                    finally:
                        wt.PACKED = was
                plain_s = None
                if m > 1:  # the plain tiled GEMM's rule (what 16-bit activations took before _gemm_t_kernel)
                    plain = wt.plan(m, n, k, layout.group_size, wt.sm_count(device) if device.type == "cuda" else 8,
                                    1 << 30, wt.uses_table(layout), False)
                    plain_s = _time_graphed(lambda c=plain: run(c), device)
                bf16_s = _time_graphed(lambda x=x, out=out, w=dense: torch.matmul(x, w.t(), out=out), device)
                # the "dense" path at this M: the whole weight dequantized to a bf16 W^T, then cuBLAS
                # (what prefill does from DENSE_FROM_TOKENS): where it beats the fused GEMM, plan()'s
                # switch belongs below this M
                dense_path_s = _time_graphed(lambda x=x, layout=layout: wt.w4a16_linear(x, layout, dense_from=1), device)
                limit_s = (packed_bytes + x.numel() * x.element_size() + out.numel() * out.element_size()) / bandwidth
                good = [t for t in timings if "s" in t and t["matches_current"]]
                best = min(good, key=lambda t: t["s"]) if good else None
                row = {"scheme": scheme_name, "layer": name, "m": m, "n": n, "k": k, "current_plan": current.__dict__,
                       "current_s": cur_s, "current_plan_general_gemv_s": general_s, "best": best, "bf16_cublas_s": bf16_s,
                       "dequantize_then_cublas_s": dense_path_s, "plain_gemm_rule_s": plain_s, "weight_read_limit_s": limit_s,
                       "current_plan_packed_tile_s": packed_s, "current_plan_float32_tile_s": float_tile_s,
                       "candidates": timings}
                results.append(row)
                if best is not None:
                    print(f"{scheme_name:5s} {name:13s} M={m:4d}: current {cur_s * 1e6:8.1f} us, best "
                          f"{best['s'] * 1e6:8.1f} us ({cur_s / best['s']:.2f}x) {best['plan']}; bf16 "
                          f"{bf16_s * 1e6:8.1f} us; dequantize + cuBLAS {dense_path_s * 1e6:8.1f} us; limit {limit_s * 1e6:7.1f} us (best at "
                          f"{limit_s / best['s']:.0%})"
                          + (f"; the general GEMV {general_s * 1e6:8.1f} us" if general_s is not None else "")
                          + (f"; plain GEMM rule {plain_s * 1e6:8.1f} us" if plain_s is not None else "")
                          + (f"; packed tile {packed_s * 1e6:8.1f} us against float32 tile {float_tile_s * 1e6:8.1f} us"
                             if packed_s is not None and float_tile_s is not None else ""),
                          flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"copy_bytes_per_s": bandwidth, "results": results}, indent=1))


if __name__ == "__main__":
    main()
