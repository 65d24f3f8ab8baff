"""`loom plugins`: list installed plugins (name, kind, distribution, version, availability)."""

from __future__ import annotations

import argparse
import sys
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
    return 0
