"""The public plugin API: what plugins/ and third-party packages import.

The attention backend contract (``AttentionBackend``, ``AttentionMetadata``, ...) needs torch,
so it is loaded on first use: ``loom plugins`` lists plugins without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .hookspecs import ENTRY_POINT_GROUP, hookimpl
from .registry import PluginError, PluginInfo, PluginRegistry, default_registry
from .specs import (
    AttentionBackendSpec,
    ModelArchitectureSpec,
    QuantizerSpec,
    SpeculativeDecoderSpec,
    normalise_name,
)

if TYPE_CHECKING:
    from .attention import AttentionBackend, AttentionMetadata, StaticAttentionBuffers, write_kv

_LAZY = {name: ".attention" for name in ("AttentionBackend", "AttentionMetadata", "StaticAttentionBuffers",
                                         "write_kv")}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)


__all__ = [
    "ENTRY_POINT_GROUP",
    "AttentionBackend",
    "AttentionBackendSpec",
    "AttentionMetadata",
    "ModelArchitectureSpec",
    "PluginError",
    "PluginInfo",
    "PluginRegistry",
    "QuantizerSpec",
    "SpeculativeDecoderSpec",
    "StaticAttentionBuffers",
    "default_registry",
    "hookimpl",
    "normalise_name",
    "write_kv",
]
