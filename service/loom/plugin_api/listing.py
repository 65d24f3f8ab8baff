"""`loom plugins`: what is installed, from which distribution, whether it can run here, and for
model plugins which ``config.json`` architectures they serve."""

from __future__ import annotations

import json

from .registry import PluginRegistry
from .specs import ModelArchitectureSpec


def plugin_rows(registry: PluginRegistry) -> list[dict[str, str]]:
    rows = []
    for info in registry.infos():
        reason = info.unavailable_reason
        spec = info.spec
        rows.append({
            "name": spec.name,
            "kind": spec.kind,
            "distribution": info.distribution,
            "version": info.version,
            "status": "available" if reason is None else f"unavailable: {reason}",
            # the Hugging Face `architectures` a model plugin serves
            "serves": ", ".join(spec.architectures) if isinstance(spec, ModelArchitectureSpec) else "",
            "summary": spec.summary,
        })
    return rows


def format_plugins(registry: PluginRegistry, as_json: bool = False) -> str:
    rows = plugin_rows(registry)
    if as_json:
        return json.dumps(rows, indent=2)
    cols = ["kind", "name", "distribution", "version", "status", "serves"]
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) if rows else len(c) for c in cols}
    lines = ["  ".join(c.upper().ljust(widths[c]) for c in cols).rstrip()]
    lines += ["  ".join(r[c].ljust(widths[c]) for c in cols).rstrip() for r in rows]
    return "\n".join(lines)
