"""`loom bench`: run workloads for Loom and, with ``--peer hf``, for transformers in the same run.

The last line printed is one JSON object with every figure and ``ratio`` (Loom over the peer).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from loom import __version__
from loom.config import EngineConfig

from .workloads import Workload, cpu_workload


def add_bench_command(sub: Any) -> None:
    p = sub.add_parser("bench", help="run benchmark workloads (C0 C1 C2 on CPU) against a peer")
    p.add_argument("--workloads", default="C0,C1,C2", help="comma-separated: C0,C1,C2")
    p.add_argument("--peer", choices=["none", "hf"], default="none", help="also run this peer in the same run")
    p.add_argument("--model-id", default=None, help="model dir or .gguf (default: embedded SmolLM2)")
    p.add_argument("--threads", type=int, default=2, help="torch threads for Loom and the peer")
    p.add_argument("--quick", action="store_true", help="tiny workloads: checks the harness, not speed")
    p.add_argument("--out", default=None, help="write the JSON result here (e.g. bench/results/cpu.json)")
    p.set_defaults(func=run_bench)


def machine_info() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform()}


async def _run_loom(cfg: EngineConfig, workloads: list[Workload]) -> dict[str, dict[str, float]]:
    from loom.engine.core_process import AsyncEngineClient

    from .run_loom import run_engine_workload

    client = AsyncEngineClient(cfg)
    await client.start()
    try:
        return {w.name: await run_engine_workload(client, w) for w in workloads}
    finally:
        await client.shutdown()


def run_bench(args: argparse.Namespace) -> int:
    from loom.model_loader import resolve_model_dir

    torch.set_num_threads(args.threads)
    names = [n.strip().upper() for n in args.workloads.split(",") if n.strip()]
    workloads = [cpu_workload(n, quick=args.quick) for n in names]
    model_dir = resolve_model_dir(args.model_id)
    max_total = max(len(p) + n for w in workloads for p, n in w.requests)
    cfg = EngineConfig(model_id=str(model_dir), device="cpu", num_threads=args.threads,
                       max_total_tokens=max(max_total, 1024), max_batch_prefill_tokens=4096)
    result: dict[str, Any] = {
        "command": "loom bench " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]),
        "loom_version": __version__,
        "machine": machine_info(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": str(args.model_id or "SmolLM2-135M-Instruct (embedded GGUF, fp32)"),
        "threads": args.threads,
        "quick": args.quick,
        "workloads": {},
    }
    loom = asyncio.run(_run_loom(cfg, workloads))
    peer: dict[str, dict[str, float]] = {}
    if args.peer == "hf":
        from .peer_hf import load_peer, run_peer

        model = load_peer(model_dir)
        for w in workloads:
            peer[w.name] = run_peer(model, w, per_batch=8 if w.name == "C2" else None)
    for w in workloads:
        entry: dict[str, Any] = {"description": w.description, "loom": loom[w.name]}
        if w.name in peer:
            entry["peer"] = {"name": "hf-generate", **peer[w.name]}
            entry["ratio"] = loom[w.name]["out_tok_s"] / peer[w.name]["out_tok_s"]
        result["workloads"][w.name] = entry
        line = f"{w.name}: loom {loom[w.name]['out_tok_s']:.1f} out tok/s"
        if w.name in peer:
            line += f", peer {peer[w.name]['out_tok_s']:.1f} out tok/s, ratio {entry['ratio']:.2f}x"
        print(line, flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result), flush=True)
    return 0
