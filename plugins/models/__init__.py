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


def _load_mixtral() -> Any:
    from .mixtral import MixtralForCausalLM

    return MixtralForCausalLM


def _load_qwen3_moe() -> Any:
    from .qwen3_moe import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM


def _load_gemma2() -> Any:
    from .gemma2 import Gemma2ForCausalLM

    return Gemma2ForCausalLM


def _load_gemma3() -> Any:
    from .gemma2 import Gemma3ForCausalLM

    return Gemma3ForCausalLM


def _load_phi3() -> Any:
    from .phi3 import Phi3ForCausalLM

    return Phi3ForCausalLM


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
    yield ModelArchitectureSpec(
        name="mixtral", summary="Mixtral (Mistral with top-k routed SiLU experts, fused expert kernel)",
        load=_load_mixtral, architectures=("MixtralForCausalLM",),
    )
    yield ModelArchitectureSpec(
        name="qwen3-moe", summary="Qwen3-MoE (Qwen3 attention, top-k routed experts, dense layers by rule)",
        load=_load_qwen3_moe, architectures=("Qwen3MoeForCausalLM",),
    )
    yield ModelArchitectureSpec(
        name="gemma2", summary="Gemma 2 (soft-capped attention and logits, alternating sliding windows)",
        load=_load_gemma2, architectures=("Gemma2ForCausalLM",),
    )
    yield ModelArchitectureSpec(
        name="gemma3", summary="Gemma 3 text (q/k norms, a RoPE table per layer type, sliding windows)",
        load=_load_gemma3, architectures=("Gemma3ForCausalLM",),
    )
    yield ModelArchitectureSpec(
        name="phi3", summary="Phi-3 / Phi-4-mini (fused qkv and gate_up checkpoints, LongRoPE, partial RoPE)",
        load=_load_phi3, architectures=("Phi3ForCausalLM",),
    )
