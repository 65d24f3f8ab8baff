"""Built-in model architectures. Implementations are imported only when a model is loaded."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from loom.plugin_api import ModelArchitectureSpec, hookimpl


def _load_llama() -> Any:
    from .llama import LlamaForCausalLM

    return LlamaForCausalLM


def _load_mistral() -> Any:
    from .llama import MistralForCausalLM

    return MistralForCausalLM


def _load_qwen2() -> Any:
    from .qwen2 import Qwen2ForCausalLM

    return Qwen2ForCausalLM


def _load_qwen3() -> Any:
    from .qwen3 import Qwen3ForCausalLM

    return Qwen3ForCausalLM


@hookimpl
def loom_model_architectures() -> Iterator[ModelArchitectureSpec]:
    yield ModelArchitectureSpec(
        name="llama", summary="Llama 1/2/3 and SmolLM (fused qkv/gate_up, GQA, RoPE scaling)",
        load=_load_llama, architectures=("LlamaForCausalLM",),
    )
    yield ModelArchitectureSpec(
        name="mistral", summary="Mistral (Llama with an optional sliding window)",
        load=_load_mistral, architectures=("MistralForCausalLM",),
    )
    yield ModelArchitectureSpec(
        name="qwen2", summary="Qwen2 / Qwen2.5 (qkv bias, per-layer sliding window)",
        load=_load_qwen2, architectures=("Qwen2ForCausalLM",),
    )
    yield ModelArchitectureSpec(
        name="qwen3", summary="Qwen3 dense (q/k RMSNorm before RoPE)",
        load=_load_qwen3, architectures=("Qwen3ForCausalLM",),
    )
