"""Make ``loom`` (service/) and ``loom_plugins`` (plugins/) importable from the source tree when
they are not installed: what setuptools' package-dir does for an installed checkout. Used by
conftest.py and by the checker scripts that run in their own process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def make_importable() -> None:
    if importlib.util.find_spec("loom") is None:
        sys.path.insert(0, str(ROOT / "service"))
    if importlib.util.find_spec("loom_plugins") is None:
        spec = importlib.util.spec_from_file_location(
            "loom_plugins", ROOT / "plugins" / "__init__.py", submodule_search_locations=[str(ROOT / "plugins")]
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["loom_plugins"] = module
        spec.loader.exec_module(module)
