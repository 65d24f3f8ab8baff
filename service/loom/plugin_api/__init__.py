"""The public plugin API: what plugins/ and third-party packages import.

Every contract a plugin implements lives here: models (``CausalLM``, ``ModelArchitectureSpec``),
speculative proposers (``Proposer``, see ``loom.plugin_api.speculative``), the attention backend
contract (``AttentionBackend``, ``AttentionMetadata``, ...) and the linear
quantization contract (``LinearMethod``, ``QuantizationConfig``, ...: see
``loom.plugin_api.quantization``; ``FusedMoEMethod`` for experts, ``loom.plugin_api.moe``) need torch, so they are loaded on first use: ``loom plugins``
lists plugins without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .hookspecs import ENTRY_POINT_GROUP, hookimpl
from .model import CausalLM
from .registry import PluginError, PluginInfo, PluginRegistry, default_registry
from .specs import (
    AttentionBackendSpec,
    ModelArchitectureSpec,
    QuantizerSpec,
    SpeculativeDecoderSpec,
    lazy_call,
    lazy_import,
    normalise_name,
)
from .speculative import DraftRequest, Proposer, ProposerContext

if TYPE_CHECKING:
    from .attention import AttentionBackend, AttentionMetadata, StaticAttentionBuffers, kv_fp8, write_kv
    from .moe import FusedMoEMethod
    from .quantization import (
        LinearMethod,
        QuantizationConfig,
        QuantizationError,
        UnquantizedLinearMethod,
        WeightLoader,
        set_weight_attrs,
    )

_LAZY = {name: ".attention" for name in ("AttentionBackend", "AttentionMetadata", "StaticAttentionBuffers",
                                         "kv_fp8", "write_kv")}
_LAZY |= {name: ".quantization" for name in ("LinearMethod", "QuantizationConfig", "QuantizationError",
                                             "UnquantizedLinearMethod", "WeightLoader", "set_weight_attrs")}
_LAZY["FusedMoEMethod"] = ".moe"


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
    "CausalLM",
    "DraftRequest",
    "FusedMoEMethod",
    "LinearMethod",
    "ModelArchitectureSpec",
    "PluginError",
    "PluginInfo",
    "PluginRegistry",
    "Proposer",
    "ProposerContext",
    "QuantizationConfig",
    "QuantizationError",
    "QuantizerSpec",
    "SpeculativeDecoderSpec",
    "StaticAttentionBuffers",
    "UnquantizedLinearMethod",
    "WeightLoader",
    "default_registry",
    "hookimpl",
    "kv_fp8",
    "lazy_call",
    "lazy_import",
    "normalise_name",
    "set_weight_attrs",
    "write_kv",
]
