"""The plugin registry: discovers plugins through the ``loom`` entry-point group.

Built-in plugins are declared in Loom's own ``pyproject.toml`` under the same group, so they go
through exactly the path a third-party package does. Duplicate names are a hard error naming
both distributions; unknown names list the valid ones.
"""

from __future__ import annotations

import importlib.metadata as md
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import pluggy

from . import hookspecs
from .specs import (
    AnySpec,
    AttentionBackendSpec,
    ModelArchitectureSpec,
    PluginKind,
    QuantizerSpec,
    SpeculativeDecoderSpec,
    normalise_name,
)

S = TypeVar("S", bound=AnySpec)

_HOOKS: dict[PluginKind, str] = {
    "attention": "loom_attention_backends",
    "model": "loom_model_architectures",
    "quantizer": "loom_quantizers",
    "speculative": "loom_speculative_decoders",
}


class PluginError(Exception):
    """A plugin problem a user can act on (duplicate name, unknown name, unavailable plugin)."""


@dataclass(frozen=True)
class PluginInfo:
    """One registered spec and where it came from (for ``loom plugins``)."""

    spec: AnySpec
    distribution: str
    version: str

    @property
    def unavailable_reason(self) -> str | None:
        try:
            return self.spec.check()
        except Exception as exc:  # a broken check() must not break listing
            return f"availability check failed: {exc!r}"


class PluginRegistry:
    """Specs of all four kinds, keyed by normalised name."""

    def __init__(self) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs)
        self._origin: dict[str, tuple[str, str]] = {}  # plugin name -> (distribution, version)
        self._infos: dict[PluginKind, dict[str, PluginInfo]] | None = None

    # -- registration -------------------------------------------------------------------------
    def load_entry_points(self) -> None:
        """Register every object declared under the ``loom`` entry-point group."""
        for ep in md.entry_points(group=hookspecs.ENTRY_POINT_GROUP):
            dist = ep.dist
            dist_name = dist.metadata["Name"] if dist is not None else "unknown"
            version = dist.version if dist is not None else "unknown"
            # Name plugins after their distribution too: pluggy would silently skip a second
            # plugin that reuses an entry-point name.
            self.register(ep.load(), f"{dist_name}:{ep.name}", dist_name, version)

    def register(self, plugin: Any, name: str, distribution: str, version: str = "0") -> None:
        """Register a plugin object (module or instance with ``@hookimpl`` functions)."""
        self._pm.register(plugin, name=name)
        self._pm.check_pending()  # misspelled hook names fail loudly
        self._origin[name] = (distribution, version)
        self._infos = None

    # -- lookup -------------------------------------------------------------------------------
    def _collect(self) -> dict[PluginKind, dict[str, PluginInfo]]:
        if self._infos is not None:
            return self._infos
        infos: dict[PluginKind, dict[str, PluginInfo]] = {kind: {} for kind in _HOOKS}
        for kind, hook_name in _HOOKS.items():
            caller = getattr(self._pm.hook, hook_name)
            for impl in caller.get_hookimpls():
                dist, version = self._origin.get(impl.plugin_name, ("unknown", "unknown"))
                for spec in impl.function() or ():
                    if spec.kind != kind:
                        raise PluginError(
                            f"plugin {impl.plugin_name!r} returned a {spec.kind} spec from {hook_name}()"
                        )
                    if spec.name in infos[kind]:
                        other = infos[kind][spec.name].distribution
                        raise PluginError(
                            f"{kind} plugin name {spec.name!r} is claimed twice: by distribution "
                            f"{other!r} and by distribution {dist!r}; uninstall one of them"
                        )
                    infos[kind][spec.name] = PluginInfo(spec, dist, version)
        self._infos = infos
        return infos

    def infos(self, kind: PluginKind | None = None) -> list[PluginInfo]:
        """All registered plugins (of one kind), in kind then name order."""
        collected = self._collect()
        kinds: Iterable[PluginKind] = [kind] if kind else list(_HOOKS)
        return [collected[k][n] for k in kinds for n in sorted(collected[k])]

    def get(self, kind: PluginKind, name: str) -> PluginInfo:
        """The plugin ``name`` of ``kind``, or a PluginError listing the valid names."""
        table = self._collect()[kind]
        key = normalise_name(name)
        if key not in table:
            valid = ", ".join(sorted(table)) or "(none installed)"
            raise PluginError(f"unknown {kind} plugin {name!r}. Choose one of: {valid}")
        return table[key]

    def require_available(self, kind: PluginKind, name: str) -> PluginInfo:
        info = self.get(kind, name)
        reason = info.unavailable_reason
        if reason is not None:
            raise PluginError(f"{kind} plugin {info.spec.name!r} is unavailable: {reason}")
        return info

    # -- typed helpers --------------------------------------------------------------------------
    def attention_backend(self, name: str) -> AttentionBackendSpec:
        spec = self.require_available("attention", name).spec
        assert isinstance(spec, AttentionBackendSpec)
        return spec

    def default_attention_backend(self, device_type: str, block_size: int = 16) -> AttentionBackendSpec:
        """The available backend of highest priority that runs on ``device_type`` with ``block_size``."""
        candidates = [
            i.spec
            for i in self.infos("attention")
            if isinstance(i.spec, AttentionBackendSpec)
            and device_type in i.spec.devices
            and block_size % i.spec.block_size_multiple == 0
            and i.unavailable_reason is None
        ]
        if not candidates:
            raise PluginError(f"no attention backend is available for device {device_type!r}")
        return max(candidates, key=lambda s: s.priority)

    def model_for_architecture(self, architectures: Iterable[str]) -> ModelArchitectureSpec:
        """The model plugin serving one of the HF ``config.architectures`` names."""
        wanted = list(architectures)
        known: list[str] = []
        for info in self.infos("model"):
            spec = info.spec
            assert isinstance(spec, ModelArchitectureSpec)
            known.extend(spec.architectures)
            if any(a in spec.architectures for a in wanted):
                return spec
        raise PluginError(
            f"unsupported model architecture {', '.join(wanted) or '(none given)'}. "
            f"Known architectures: {', '.join(sorted(known))}"
        )

    def quantizer(self, name: str) -> QuantizerSpec:
        spec = self.require_available("quantizer", name).spec
        assert isinstance(spec, QuantizerSpec)
        return spec

    def speculative_decoder(self, name: str) -> SpeculativeDecoderSpec:
        spec = self.require_available("speculative", name).spec
        assert isinstance(spec, SpeculativeDecoderSpec)
        return spec


_default: PluginRegistry | None = None


def default_registry() -> PluginRegistry:
    """The process-wide registry, loaded from entry points on first use."""
    global _default
    if _default is None:
        registry = PluginRegistry()
        registry.load_entry_points()
        _default = registry
    return _default
