"""`loom plugins`: list installed plugins (name, kind, distribution, version, availability)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from .listing import format_plugins
from .registry import PluginError, default_registry


def add_plugins_command(sub: Any) -> None:
    p = sub.add_parser("plugins", help="list installed plugins and whether they can run here")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run_plugins)


def run_plugins(args: argparse.Namespace) -> int:
    try:
        print(format_plugins(default_registry(), as_json=args.json))
    except PluginError as exc:
        print(f"loom plugins: {exc}", file=sys.stderr)
        return 1
    if not args.json:
        print(f"\n{shard_capacity_line(visible_gpus())}")
    return 0


def visible_gpus(driver_dir: Path = Path("/proc/driver/nvidia/gpus")) -> int:
    """NVIDIA GPUs this process may use, without importing torch (``loom plugins`` stays light):
    the driver's count, capped by ``CUDA_VISIBLE_DEVICES`` when it is set."""
    try:
        count = sum(1 for _ in driver_dir.iterdir())
    except OSError:
        count = 0
    chosen = os.environ.get("CUDA_VISIBLE_DEVICES")
    if chosen is not None:
        count = min(count, len([d for d in chosen.split(",") if d.strip()]))
    return count


def shard_capacity_line(gpus: int) -> str:
    """How many tensor-parallel shards (``loom serve --num-shard``) this machine can run."""
    gpu_part = (f"up to {gpus} on the {gpus} GPU{'s' if gpus != 1 else ''} visible here (NCCL, one per shard)"
                if gpus else "no GPU visible here")
    return f"tensor parallelism (loom serve --num-shard N): {gpu_part}; any N of gloo shards with --device cpu"
