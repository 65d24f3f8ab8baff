"""Typed specs that plugins yield from their hooks.

Every spec is a frozen dataclass holding a *name* (normalised to lower-case kebab), a one-line
summary, and a zero-argument ``load`` callable that imports the implementation lazily, so
listing plugins never imports a kernel library. ``check`` returns ``None`` when the plugin can
run here, or a sentence saying why not (for example "flash-attn is not installed").
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

PluginKind = Literal["attention", "quantizer", "speculative", "model"]


def normalise_name(name: str) -> str:
    """``Flash_Attn`` -> ``flash-attn``: names compare case- and separator-insensitively."""
    return re.sub(r"[\s_]+", "-", name.strip().lower())


def _always_available() -> str | None:
    return None


def _attribute(package: str, module: str, name: str) -> Any:
    return getattr(importlib.import_module(module, package), name)


def _call(package: str, module: str, name: str) -> Any:
    return _attribute(package, module, name)()


def lazy_import(package: str, module: str, name: str) -> Callable[[], Any]:
    """A spec's ``load``: ``name`` from ``module`` (relative to ``package``: pass ``__name__``),
    imported only when called, e.g. ``load=lazy_import(__name__, ".gptq", "GPTQConfig")``."""
    return functools.partial(_attribute, package, module, name)


def lazy_call(package: str, module: str, name: str) -> Callable[[], Any]:
    """A spec's ``check``: calls ``name`` from ``module`` (imported then) and returns its answer,
    e.g. ``check=lazy_call(__name__, ".fp8", "unsupported_reason")``."""
    return functools.partial(_call, package, module, name)


@dataclass(frozen=True)
class _Spec:
    name: str
    summary: str
    load: Callable[[], Any]
    check: Callable[[], str | None] = field(default=_always_available, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", normalise_name(self.name))


@dataclass(frozen=True)
class AttentionBackendSpec(_Spec):
    """An attention backend: ``load()`` returns a subclass of ``loom.plugin_api.AttentionBackend``.

    ``devices`` lists the torch device types it runs on; ``priority`` orders the automatic choice
    (higher wins among available backends for the device).
    """

    devices: tuple[str, ...] = ("cpu", "cuda")
    priority: int = 0
    block_size_multiple: int = 1  # KV block sizes it supports: multiples of this
    kind: PluginKind = "attention"


@dataclass(frozen=True)
class ModelArchitectureSpec(_Spec):
    """A model architecture: ``load()`` returns an ``nn.Module`` class built from a HF config.

    ``architectures`` are the Hugging Face ``config.architectures`` names it serves
    (``LlamaForCausalLM``...).
    """

    architectures: tuple[str, ...] = ()
    kind: PluginKind = "model"


@dataclass(frozen=True)
class QuantizerSpec(_Spec):
    """A weight quantizer: ``load()`` returns a ``loom.plugin_api.quantization.QuantizationConfig``
    subclass, which picks each linear layer's method when the model is built."""

    kind: PluginKind = "quantizer"


@dataclass(frozen=True)
class SpeculativeDecoderSpec(_Spec):
    """A speculative decoder: ``load()`` returns a ``loom.plugin_api.Proposer`` subclass (draft
    tokens for verification; the contract is in ``loom.plugin_api.speculative``)."""

    kind: PluginKind = "speculative"


AnySpec = AttentionBackendSpec | ModelArchitectureSpec | QuantizerSpec | SpeculativeDecoderSpec
