"""The hooks a Loom plugin may implement. Each returns an iterable of typed specs.

A plugin is any module or object registered under the ``loom`` entry-point group::

    [project.entry-points.loom]
    my-dist = "my_package.loom_plugin"

and decorated with :data:`hookimpl`. Implementations may take fewer arguments than the spec
(pluggy's rule), so hooks can grow without breaking plugins.
"""

from __future__ import annotations

from collections.abc import Iterable

import pluggy

from .specs import AttentionBackendSpec, ModelArchitectureSpec, QuantizerSpec, SpeculativeDecoderSpec

PROJECT = "loom"
ENTRY_POINT_GROUP = "loom"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def loom_attention_backends() -> Iterable[AttentionBackendSpec]:  # type: ignore[empty-body]
    """Yield attention backends."""


@hookspec
def loom_model_architectures() -> Iterable[ModelArchitectureSpec]:  # type: ignore[empty-body]
    """Yield model architectures."""


@hookspec
def loom_quantizers() -> Iterable[QuantizerSpec]:  # type: ignore[empty-body]
    """Yield weight quantizers."""


@hookspec
def loom_speculative_decoders() -> Iterable[SpeculativeDecoderSpec]:  # type: ignore[empty-body]
    """Yield speculative decoders."""
