"""Shared fixtures. Also makes the source tree importable without ``pip install -e .``:
``loom`` from service/, ``loom_plugins`` from plugins/ and the ``helpers`` package from tests/.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import helpers`
from helpers.source_tree import make_importable

make_importable()

from helpers.tiny_models import save_tiny_model  # noqa: E402

from loom.plugin_api import PluginRegistry  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def cpu_kernel_built() -> bool:
    """Compile the CPU kernels (the torch backend's attention, the gguf quantizer's linear, the
    fused norm / RoPE / SiLU) once, before any server process starts: they then load them from
    torch's extension cache instead of compiling them during their start-up."""
    from loom.layers import cpu_fused
    from loom_plugins.attention.cpu_kernels import cpu_decode_kernel_available
    from loom_plugins.quant.gguf import kernel_available

    kernel_available()
    cpu_fused.available()
    return cpu_decode_kernel_available()


@pytest.fixture(scope="session")
def models_registry() -> PluginRegistry:
    """A registry holding only the built-in model architectures (no entry points needed)."""
    import loom_plugins.models

    registry = PluginRegistry()
    registry.register(loom_plugins.models, "loom-models", "loom-server")
    return registry


@pytest.fixture(scope="session")
def quant_registry() -> PluginRegistry:
    """The built-in model architectures and quantizers (no entry points needed)."""
    import loom_plugins.models
    import loom_plugins.quant

    registry = PluginRegistry()
    registry.register(loom_plugins.models, "loom-models", "loom-server")
    registry.register(loom_plugins.quant, "loom-quant", "loom-server")
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


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A random-weight 2-layer Llama whose vocabulary is SmolLM2's, with SmolLM2's tokenizer files
    (float32, seeded), built once per session for every test that needs a fast model with a real
    vocabulary (grammars, the e2e servers)."""
    from helpers.tiny_models import save_tiny_llama_with_vocab_of

    return save_tiny_llama_with_vocab_of(default_model_dir, tmp_path_factory.mktemp("tiny-llama-smol-vocab"))


@pytest.fixture(scope="session")
def make_engine(tiny_model_dir: Callable[[str], Path]) -> Callable[..., Any]:
    """``make_engine(**config)``: an in-process LLMEngine on the tiny Llama, 4-token blocks."""
    from loom.config import EngineConfig
    from loom.engine.llm_engine import LLMEngine

    path = tiny_model_dir("llama")

    def make(**kw: Any) -> LLMEngine:
        return LLMEngine(EngineConfig(model_id=str(path), block_size=4, **kw))

    return make
