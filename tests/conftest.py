"""Shared fixtures. Also makes the source tree importable without ``pip install -e .``:
``loom`` from service/, ``loom_plugins`` from plugins/ and the ``helpers`` package from tests/.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import helpers`
if importlib.util.find_spec("loom") is None:
    sys.path.insert(0, str(ROOT / "service"))
if importlib.util.find_spec("loom_plugins") is None:
    # Not installed: import plugins/ as the loom_plugins package (what setuptools' package-dir does).
    _spec = importlib.util.spec_from_file_location(
        "loom_plugins", ROOT / "plugins" / "__init__.py", submodule_search_locations=[str(ROOT / "plugins")]
    )
    assert _spec is not None and _spec.loader is not None
    _plugins = importlib.util.module_from_spec(_spec)
    sys.modules["loom_plugins"] = _plugins
    _spec.loader.exec_module(_plugins)

from helpers.tiny_models import save_tiny_model  # noqa: E402

from loom.plugin_api import PluginRegistry  # noqa: E402


@pytest.fixture(scope="session")
def models_registry() -> PluginRegistry:
    """A registry holding only the built-in model architectures (no entry points needed)."""
    import loom_plugins.models

    registry = PluginRegistry()
    registry.register(loom_plugins.models, "loom-models", "loom-server")
    return registry


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_model_dir(name)``: a saved tiny HF model of TINY_CONFIGS[name], built once per session."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = save_tiny_model(name, tmp_path_factory.mktemp(f"tiny-{name}"))
        return made[name]

    return get


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The bundled SmolLM2 GGUF converted into the cache ($LOOM_CACHE_DIR or ~/.cache/loom)."""
    from loom.model_loader import resolve_model_dir

    return resolve_model_dir(None)
