"""Sweep of the MoE experts' tile plans at one token (#22), for ``loom.layers.moe_plan_table``.

A one-token decode step of the Qwen3-30B-A3B shape (hidden 2048, 128 experts of 768, 8 a token,
bf16) runs its experts straight from the routing's ids (``direct_experts``): ``_gate_up_kernel``
over the 8 chosen experts' gate and up rows (8 x 6.3 MB) and ``_down_kernel`` over their down
rows (8 x 3.1 MB). Each kernel is timed alone for each candidate tiling, 48 layers' worth
captured in one CUDA graph and replayed; the 48 launches cycle through 16 disjoint sets of 8
experts of one layer's weights, so no launch finds its experts in the L2 cache. Reported: us a
layer, the rate of the expert bytes against a device copy's, the best plan of each kernel, and
the table entry to paste into ``moe_plan_table.PLANS`` (only where it beats the default by 3%).

First row of each kernel: the default tiles with the K mask in the loop, as before the
``EVEN_K`` loop (that mask kept triton 3.6 from pipelining the loads: no cp.async at any stage
count, checked by compiling for sm_90). Prediction (2026-12-03 profile: gate/up 15.2 us at 87%,
down 8.8 us at 75% of the copy rate): the pipelined default brings down to ~85% (~7.7 us) and
gate/up to ~92% (~14.3 us); of the other tilings, 32-wide gate/up tiles (192 programs for 132
SMs, where 64-wide ones leave 36 SMs idle) should gain another ~0.5 us.

    PYTHONPATH=service python3 scripts/bench_moe_plans.py [--out FILE]
    python3 scripts/bench_moe_plans.py --fill-table FILE   # the sweep's entry into moe_plan_table.PLANS
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))

from bench_fused_moe import copy_bandwidth  # the same device copy (1 GiB here)
from sweep_common import graphed_us_per_call

from loom.layers.fused_moe_triton import MoeBlockConfig, block_config, launch_down, launch_gate_up

HIDDEN, INTER, EXPERTS, TOP_K, LAYERS = 2048, 768, 128, 8, 48
SETS = EXPERTS // TOP_K  # disjoint expert sets the launches cycle through
REPLAYS = 20
MARGIN = 0.03  # a plan enters the table only if it beats the default by this much

# (block_n, block_k, num_warps, num_stages); the first is block_config's default.
CANDIDATES: list[tuple[int, int, int, int]] = [
    (64, 128, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (128, 128, 4, 3),
    (64, 256, 4, 3), (64, 128, 4, 6), (32, 128, 2, 6), (16, 256, 4, 4), (64, 64, 4, 8),
]


TABLE = Path(__file__).resolve().parents[1] / "service" / "loom" / "layers" / "moe_plan_table.py"


def fill_table(results: Path, table: Path) -> str:
    """Put the sweep's entry (``table_entry`` of its JSON) into ``PLANS``, replacing an entry of
    the same key; returns the entry. An entry that keeps both defaults is written all the same:
    it records that the shape was measured."""
    entry = json.loads(results.read_text())["table_entry"]
    key = entry.split(":", 1)[0]
    text = table.read_text()
    head, sep, body = text.partition("PLANS: dict[tuple[int, int, int, str], tuple[PlanTiles, PlanTiles]] = {")
    if not sep:
        raise SystemExit(f"{table}: no PLANS literal to fill")
    body = body.lstrip("\n")
    entries, _, tail = body.partition("}")
    lines = [line for line in entries.splitlines() if line.strip() and not line.strip().startswith(key)]
    lines.append(f"    {entry}  # {results.name}")
    table.write_text(head + sep + "\n" + "\n".join(lines) + "\n}" + tail)
    return entry


def per_layer_us(step: Callable[[int], Any]) -> float:
    """Device time a layer of ``step(layer)``: LAYERS calls in one graph, replayed REPLAYS times."""
    return graphed_us_per_call(step, LAYERS, REPLAYS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--fill-table", type=Path, default=None,
                        help="write the table entry of this sweep's JSON into moe_plan_table.py (no GPU needed)")
    args = parser.parse_args()
    if args.fill_table:
        print(fill_table(args.fill_table, TABLE))
        return
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=dev, dtype=dt, generator=gen) * 0.02
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device=dev, dtype=dt, generator=gen) * 0.02
    x = torch.randn(1, HIDDEN, device=dev, dtype=dt, generator=gen)
    perm = torch.randperm(EXPERTS, device=dev, generator=gen).to(torch.int32)
    ids = [perm[s * TOP_K:(s + 1) * TOP_K].contiguous() for s in range(SETS)]  # [k] int32 each
    act = torch.randn(TOP_K, INTER, device=dev, dtype=dt, generator=gen)
    y = torch.empty(TOP_K, HIDDEN, device=dev, dtype=dt)
    act_out = torch.empty(TOP_K, INTER, device=dev, dtype=dt)
    rate = copy_bandwidth(dev, 1 << 30)
    base = block_config(1, 1, dt)
    kernels: dict[str, tuple[int, Callable[[MoeBlockConfig], Callable[[int], Any]]]] = {
        "gate_up": (TOP_K * 2 * INTER * HIDDEN * 2,
                    lambda cfg: lambda layer: launch_gate_up(x, w13, act_out, ids[layer % SETS], ids[layer % SETS],
                                                             ids[layer % SETS], TOP_K, cfg, True)),
        "down": (TOP_K * HIDDEN * INTER * 2,
                 lambda cfg: lambda layer: launch_down(act, w2, y, ids[layer % SETS], ids[layer % SETS],
                                                       ids[layer % SETS], cfg, True)),
    }
    results: list[dict[str, Any]] = []
    best: dict[str, tuple[float, tuple[int, int, int, int]]] = {}
    # Before this change: the default tiles with the K mask in the loop (no cp.async pipelining).
    masked = {
        "gate_up": lambda layer: launch_gate_up(x, w13, act_out, ids[layer % SETS], ids[layer % SETS],
                                                ids[layer % SETS], TOP_K, base, True, even_k=False),
        "down": lambda layer: launch_down(act, w2, y, ids[layer % SETS], ids[layer % SETS], ids[layer % SETS],
                                          base, True, even_k=False),
    }
    masked_us: dict[str, float] = {}
    for name, step in masked.items():
        masked_us[name] = round(per_layer_us(step), 2)
        nbytes = kernels[name][0]
        row = {"kernel": name, "tiles": "default, K-masked loop (before)", "us": masked_us[name],
               "pct_of_copy": round(100 * nbytes / (masked_us[name] * 1e-6) / rate, 1)}
        results.append(row)
        print(json.dumps(row), flush=True)
    for name, (nbytes, make) in kernels.items():
        for tiles in CANDIDATES:
            cfg = MoeBlockConfig(base.block_m, *tiles)
            try:
                us = per_layer_us(make(cfg))
            except Exception as exc:  # a tiling that does not fit (shared memory): reported, skipped
                print(json.dumps({"kernel": name, "tiles": tiles, "error": str(exc)[:200]}), flush=True)
                continue
            row = {"kernel": name, "tiles": tiles, "us": round(us, 2), "pct_of_copy": round(100 * nbytes / (us * 1e-6) / rate, 1)}
            results.append(row)
            print(json.dumps(row), flush=True)
            if name not in best or us < best[name][0]:
                best[name] = (us, tiles)
    default = {r["kernel"]: r["us"] for r in results if tuple(r["tiles"]) == CANDIDATES[0]}
    chosen = {name: (tiles if us < default.get(name, float("inf")) * (1 - MARGIN) else CANDIDATES[0])
              for name, (us, tiles) in best.items()}
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    entry = f"({sms}, {HIDDEN}, {INTER}, 'bfloat16'): ({chosen.get('gate_up')}, {chosen.get('down')}),"
    summary = {"device": torch.cuda.get_device_name(), "copy_rate_gbs": round(rate / 1e9, 1),
               "k_masked_default_us": masked_us, "default_us": default,
               "best": {k: {"us": round(v[0], 2), "tiles": v[1]} for k, v in best.items()}, "table_entry": entry}
    print(json.dumps(summary), flush=True)
    if args.out:
        args.out.write_text(json.dumps({**summary, "layers": LAYERS, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
