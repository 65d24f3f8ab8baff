"""What the plan sweeps (``bench_decode_plans.py``, ``bench_fp8_decode_plans.py``,
``bench_dense_gemv.py``, ``bench_fp8_gemv.py``) share around their timing: the command line's
common options, the ``main()`` that either fills a table from a sweep's JSON or sweeps (on the
CPU under Triton's interpreter with ``--interpret``), and the writing of a table module.

A table module is hand-written text (its docstring, imports, the reader's notes) down to its
generated part: a ``# From RESULTS (device, ...), margin N%.`` line and the ``PLANS`` dict, one
entry a line. ``--fill-table`` keeps the head and rewrites the generated part; each script says
only what its keys, values and comments are.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def table_head(text: str) -> str:
    """A table module's text before its generated part (the ``# From`` note and ``PLANS``)."""
    lines = text.splitlines(keepends=True)
    end = next(i for i, line in enumerate(lines) if line.startswith(("# From ", "PLANS")))
    return "".join(lines[:end])


def entry_line(key: tuple[Any, ...], value: tuple[Any, ...], comment: str) -> str:
    """One ``PLANS`` entry: ``key: value,  # comment``, indented as the dict's body."""
    return f"    {key!r}: {value!r},  # {comment}"


def fill_rule_table(results_path: Path, margin: float, table: Path, annotation: str,
                    value: Callable[[dict[str, Any]], tuple[Any, ...]]) -> list[str]:
    """Write a decode-plan table (keyed by SM count, KV heads, group, head size, batch) from a
    sweep's JSON: the choices at least ``1 + margin`` times faster than the rule (geometric mean
    over the contexts), each plan written as ``value(plan)``. Returns the entries' lines."""
    data = json.loads(results_path.read_text())
    lines = []
    for c in data["choices"]:
        if not c["speedup_vs_rule"] >= 1.0 + margin:
            continue
        key = (data["sms"], c["hkv"], c["group"], c["head_dim"], c["batch"])
        lines.append(entry_line(key, value(c["plan"]), f"{c['layout']}: {c['speedup_vs_rule']:.2f}x the rule"))
    write_table(table, results_path, data, lines, margin=margin, annotation=annotation, bound=True)
    return lines


def write_table(table: Path, results_path: Path, data: dict[str, Any], lines: list[str], *, margin: float,
                annotation: str, bound: bool) -> None:
    """Rewrite ``table``'s generated part: the ``# From`` note (the results file, its device, the
    graphs' bound where ``bound``, cold or warm L2, ``margin``) and ``PLANS: annotation = {lines}``."""
    head = table_head(table.read_text())
    body = "{\n" + "\n".join(lines) + "\n}" if lines else "{}"
    where = f"bound {data['bound']}, " if bound else ""
    table.write_text(f"{head}# From {results_path.name} ({data.get('device', '?')}, {where}"
                     f"{'cold' if data.get('cold_l2', True) else 'warm'} L2), margin {margin:.0%}.\n"
                     f"PLANS: {annotation} = {body}\n")


def add_common_args(parser: argparse.ArgumentParser, *, what: str, table: Path, margin: float, margin_help: str,
                    budget_s: float) -> None:
    """--out, --fill-table (writes ``what``), --table, --margin, --budget-s and --jobs."""
    parser.add_argument("--out", help="write every timing and the choices as JSON here")
    parser.add_argument("--fill-table", metavar="RESULTS", help=f"write {what} from a sweep's JSON")
    parser.add_argument("--table", default=str(table), help="the table module --fill-table writes")
    parser.add_argument("--margin", type=float, default=margin, help=margin_help)
    parser.add_argument("--budget-s", type=float, default=budget_s, help="stop sweeping after this long")
    parser.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="compiling processes")


def add_decode_args(parser: argparse.ArgumentParser, *, batches: tuple[int, ...], contexts: tuple[int, ...]) -> None:
    """The decode-plan sweeps' --bound, --layouts, --batches and --contexts."""
    parser.add_argument("--bound", type=int, default=4096, help="the CUDA graphs' max_seq_len (the rule's input)")
    parser.add_argument("--layouts", help="names from LAYOUTS, comma-separated (default: all)")
    parser.add_argument("--batches", default=",".join(map(str, batches)))
    parser.add_argument("--contexts", default=",".join(map(str, contexts)))


def add_mode_args(parser: argparse.ArgumentParser) -> None:
    """--warm and --interpret (after each script's own options, as --help lists them)."""
    parser.add_argument("--warm", action="store_true", help="no L2 flush between calls")
    parser.add_argument("--interpret", action="store_true", help="a tiny CPU check of the script (TRITON_INTERPRET=1)")


def sweep_main(args: argparse.Namespace, fill: Callable[[Path, Path], list[str]],
               sweep: Callable[[argparse.Namespace], dict[str, Any]]) -> None:
    """With --fill-table: ``fill(results, table)`` and print its entries. Otherwise sweep (under
    Triton's interpreter with --interpret) and write the result to --out when given."""
    if args.fill_table:
        lines = fill(Path(args.fill_table), Path(args.table))
        print(f"{args.table}: {len(lines)} entries" + "".join(f"\n{line}" for line in lines))
        return
    if args.interpret:
        sys.path.insert(0, str(ROOT / "tests"))
        from helpers import triton_interpret

        triton_interpret.setup_script()
    result = sweep(args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
