"""The public plugin API: what plugins/ and third-party packages import."""

from .hookspecs import ENTRY_POINT_GROUP, hookimpl
from .registry import PluginError, PluginInfo, PluginRegistry, default_registry
from .specs import (
    AttentionBackendSpec,
    ModelArchitectureSpec,
    QuantizerSpec,
    SpeculativeDecoderSpec,
    normalise_name,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "AttentionBackendSpec",
    "ModelArchitectureSpec",
    "PluginError",
    "PluginInfo",
    "PluginRegistry",
    "QuantizerSpec",
    "SpeculativeDecoderSpec",
    "default_registry",
    "hookimpl",
    "normalise_name",
]
