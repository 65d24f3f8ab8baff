"""The plugin registry: entry points, duplicate names, unknown names, availability."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import pytest

from loom.plugin_api import (
    AttentionBackendSpec,
    ModelArchitectureSpec,
    PluginError,
    PluginRegistry,
    default_registry,
    hookimpl,
)
from loom.plugin_api.listing import format_plugins


class _Backends:
    def __init__(self, *specs: AttentionBackendSpec) -> None:
        self.specs = specs

    @hookimpl
    def loom_attention_backends(self) -> Iterable[AttentionBackendSpec]:
        return self.specs


def spec(name: str, check: str | None = None, priority: int = 0) -> AttentionBackendSpec:
    return AttentionBackendSpec(name=name, summary="test", load=lambda: object, check=lambda: check,
                                priority=priority)


def test_builtins_come_through_the_entry_point_group() -> None:
    reg = default_registry()
    rows = {(i.spec.kind, i.spec.name): i.distribution for i in reg.infos()}
    assert rows[("attention", "torch")] == "loom-server"
    for name in ("llama", "mistral", "qwen2", "qwen3"):
        assert rows[("model", name)] == "loom-server"


def test_duplicate_name_names_both_distributions() -> None:
    reg = PluginRegistry()
    reg.register(_Backends(spec("fast")), "a", "dist-one", "1.0")
    reg.register(_Backends(spec("Fast")), "b", "dist-two", "2.0")
    with pytest.raises(PluginError, match=r"'fast' is claimed twice.*'dist-one'.*'dist-two'"):
        reg.infos()


def test_unknown_name_lists_the_valid_ones() -> None:
    reg = PluginRegistry()
    reg.register(_Backends(spec("alpha"), spec("beta")), "a", "dist")
    with pytest.raises(PluginError, match="Choose one of: alpha, beta"):
        reg.get("attention", "gamma")


def test_names_are_normalised() -> None:
    reg = PluginRegistry()
    reg.register(_Backends(spec("Flash_Attn")), "a", "dist")
    assert reg.get("attention", "flash-attn").spec.name == "flash-attn"


def test_unavailable_plugin_says_why_and_is_not_chosen() -> None:
    reg = PluginRegistry()
    reg.register(_Backends(spec("gpu-only", check="needs CUDA", priority=10), spec("plain")), "a", "dist")
    with pytest.raises(PluginError, match="unavailable: needs CUDA"):
        reg.attention_backend("gpu-only")
    assert reg.default_attention_backend("cpu").name == "plain"
    assert "unavailable: needs CUDA" in format_plugins(reg)


def test_loom_plugins_lists_the_architectures_each_model_plugin_serves() -> None:
    class Models:
        @hookimpl
        def loom_model_architectures(self) -> Iterable[ModelArchitectureSpec]:
            return [ModelArchitectureSpec(name="two", summary="", load=lambda: object,
                                          architectures=("AForCausalLM", "BForCausalLM"))]

    reg = PluginRegistry()
    reg.register(Models(), "m", "dist")
    reg.register(_Backends(spec("plain")), "a", "dist")
    text = format_plugins(reg).splitlines()
    assert text[0].split() == ["KIND", "NAME", "DISTRIBUTION", "VERSION", "STATUS", "SERVES"]
    assert text[2].split()[-2:] == ["AForCausalLM,", "BForCausalLM"]
    rows = {r["name"]: r for r in json.loads(format_plugins(reg, as_json=True))}
    assert rows["two"]["serves"] == "AForCausalLM, BForCausalLM" and rows["plain"]["serves"] == ""


def test_unknown_architecture_lists_known_ones() -> None:
    class Models:
        @hookimpl
        def loom_model_architectures(self) -> Iterable[ModelArchitectureSpec]:
            return [ModelArchitectureSpec(name="llama", summary="", load=lambda: object,
                                          architectures=("LlamaForCausalLM",))]

    reg = PluginRegistry()
    reg.register(Models(), "m", "dist")
    with pytest.raises(PluginError, match=r"unsupported model architecture GPT2LMHeadModel\. Known architectures: LlamaForCausalLM"):
        reg.model_for_architecture(["GPT2LMHeadModel"])


def test_misspelled_hook_fails_loudly() -> None:
    class Typo:
        @hookimpl
        def loom_attention_backend(self) -> list[object]:  # missing the final "s"
            return []

    reg = PluginRegistry()
    with pytest.raises(Exception, match="unknown hook"):
        reg.register(Typo(), "typo", "dist")


def test_lazy_import_and_call_import_only_when_called(monkeypatch: pytest.MonkeyPatch) -> None:
    """The built-in specs' ``load`` / ``check``: the module is imported when the spec is used,
    not when it is listed, and every built-in loads the class it names."""
    import sys

    from loom.plugin_api import lazy_call, lazy_import

    monkeypatch.delitem(sys.modules, "json.tool", raising=False)
    load = lazy_import("json", ".tool", "main")
    assert "json.tool" not in sys.modules
    assert load() is sys.modules["json.tool"].main
    assert lazy_call("os", "os", "getcwd")() == __import__("os").getcwd()
    for info in default_registry().infos():
        reason = info.spec.check()
        assert reason is None or isinstance(reason, str), info.spec.name
        if reason is None:  # (an unavailable one may not import here: flash-attn missing)
            assert isinstance(info.spec.load(), type), info.spec.name


def test_quantization_config_serves_its_quant_methods_by_default(tmp_path: Path) -> None:
    """A quantizer that names ``quant_methods`` needs no ``for_checkpoint`` of its own."""
    from loom.plugin_api import QuantizationConfig

    class Mine(QuantizationConfig):
        quant_methods = ("mine", "mine-v2")

        def get_linear_method(self, layer: object, prefix: str) -> None:
            return None

    config = tmp_path / "config.json"
    for body, want in (({"quantization_config": {"quant_method": "MINE"}}, True),
                       ({"quantization_config": {"quant_method": "mine-v2"}}, True),
                       ({"quantization_config": {"quant_method": "gptq"}}, False),
                       ({"architectures": ["LlamaForCausalLM"]}, False)):
        config.write_text(json.dumps(body))
        assert Mine.for_checkpoint(tmp_path) is want, body
