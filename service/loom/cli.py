"""The ``loom`` command. Each subcommand lives in its own module and registers itself here.

A subcommand module exposes ``add_<name>_command(subparsers)``, which adds its parser and sets
``func`` (called with the parsed namespace, returning the exit code). Register it by adding
``"module:function"`` to :data:`SUBCOMMANDS`; modules are imported when the CLI starts, so they
keep heavy imports inside ``func``.

Every flag declared with :func:`add_env_argument` can also be set through ``LOOM_<FLAG>``
(``--max-input-tokens`` -> ``LOOM_MAX_INPUT_TOKENS``); a flag on the command line wins.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

SUBCOMMANDS: list[str] = [
    "loom.server.serve_command:add_serve_command",
    "loom.plugin_api.command:add_plugins_command",
    "loom.bench.command:add_bench_command",
    "loom_plugins.quant.make.command:add_quantize_command",
]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_name(flag: str) -> str:
    return "LOOM_" + flag.lstrip("-").replace("-", "_").upper()


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"expected one of {sorted(_TRUE | _FALSE - {''})}, got {text!r}")


def parse_key_value(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` of a repeatable option (``--speculator-option``) -> (KEY, VALUE)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()


def add_env_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup, flag: str, *,
                     type: Callable[[str], Any] | None = None, default: Any = None, help: str = "",
                     flag_is_switch: bool = False) -> None:
    """Add ``flag`` whose default comes from its ``LOOM_*`` variable when that is set."""
    var = env_name(flag)
    raw = os.environ.get(var)
    if raw is not None:
        try:
            default = parse_bool(raw) if flag_is_switch else (type(raw) if type else raw)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            print(f"loom: environment variable {var}={raw!r}: {exc}", file=sys.stderr)
            raise SystemExit(2) from exc
    text = f"{help} [env {var}]" if help else f"[env {var}]"
    if flag_is_switch:
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=bool(default), help=text)
    else:
        parser.add_argument(flag, type=type or str, default=default,
                            help=text + (f" (default: {default})" if default is not None else ""))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loom", description="Loom: a gRPC-first LLM inference server.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for entry in SUBCOMMANDS:
        module_name, _, func_name = entry.partition(":")
        getattr(importlib.import_module(module_name), func_name)(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return int(func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
