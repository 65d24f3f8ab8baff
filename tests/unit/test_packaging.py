"""The wheel holds every package of the source tree: pyproject.toml lists packages by hand
(setuptools' package-dir maps service/ to loom and plugins/ to loom_plugins), so a new folder
that is not listed works from a checkout and fails in an installed server."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_in_pyproject() -> None:
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for base, name in ((ROOT / "service" / "loom", "loom"), (ROOT / "plugins", "loom_plugins")):
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            found.add(".".join((name, *rel.parts)))
    assert "loom.engine" in found and "loom_plugins.quant" in found
    assert found - listed == set(), f"add to [tool.setuptools] packages in pyproject.toml: {sorted(found - listed)}"
