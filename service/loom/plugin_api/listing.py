"""`loom plugins`: what is installed, from which distribution, and whether it can run here."""

from __future__ import annotations

import json

from .registry import PluginRegistry


def plugin_rows(registry: PluginRegistry) -> list[dict[str, str]]:
    rows = []
    for info in registry.infos():
        reason = info.unavailable_reason
        rows.append({
            "name": info.spec.name,
            "kind": info.spec.kind,
            "distribution": info.distribution,
            "version": info.version,
            "status": "available" if reason is None else f"unavailable: {reason}",
            "summary": info.spec.summary,
        })
    return rows


def format_plugins(registry: PluginRegistry, as_json: bool = False) -> str:
    rows = plugin_rows(registry)
    if as_json:
        return json.dumps(rows, indent=2)
    cols = ["kind", "name", "distribution", "version", "status"]
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) if rows else len(c) for c in cols}
    lines = ["  ".join(c.upper().ljust(widths[c]) for c in cols).rstrip()]
    lines += ["  ".join(r[c].ljust(widths[c]) for c in cols).rstrip() for r in rows]
    return "\n".join(lines)
