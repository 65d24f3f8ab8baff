"""Built-in model architectures. Implementations are imported only when a model is loaded."""

from __future__ import annotations

from collections.abc import Iterator

from loom.plugin_api import ModelArchitectureSpec, hookimpl, lazy_import


@hookimpl
def loom_model_architectures() -> Iterator[ModelArchitectureSpec]:
    yield ModelArchitectureSpec(
        name="llama", summary="Llama 1/2/3 and SmolLM (fused qkv/gate_up, GQA, RoPE scaling)",
        load=lazy_import(__name__, ".llama", "LlamaForCausalLM"), architectures=("LlamaForCausalLM",),
    )
    yield ModelArchitectureSpec(
        name="mistral", summary="Mistral (Llama with an optional sliding window)",
        load=lazy_import(__name__, ".llama", "MistralForCausalLM"), architectures=("MistralForCausalLM",),
    )
    yield ModelArchitectureSpec(
        name="qwen2", summary="Qwen2 / Qwen2.5 (qkv bias, per-layer sliding window)",
        load=lazy_import(__name__, ".qwen2", "Qwen2ForCausalLM"), architectures=("Qwen2ForCausalLM",),
    )
    yield ModelArchitectureSpec(
        name="qwen3", summary="Qwen3 dense (q/k RMSNorm before RoPE)",
        load=lazy_import(__name__, ".qwen3", "Qwen3ForCausalLM"), architectures=("Qwen3ForCausalLM",),
    )
    yield ModelArchitectureSpec(
        name="mixtral", summary="Mixtral (Mistral with top-k routed SiLU experts, fused expert kernel)",
        load=lazy_import(__name__, ".mixtral", "MixtralForCausalLM"), architectures=("MixtralForCausalLM",),
    )
    yield ModelArchitectureSpec(
        name="qwen3-moe", summary="Qwen3-MoE (Qwen3 attention, top-k routed experts, dense layers by rule)",
        load=lazy_import(__name__, ".qwen3_moe", "Qwen3MoeForCausalLM"), architectures=("Qwen3MoeForCausalLM",),
    )
    yield ModelArchitectureSpec(
        name="gemma2", summary="Gemma 2 (soft-capped attention and logits, alternating sliding windows)",
        load=lazy_import(__name__, ".gemma2", "Gemma2ForCausalLM"), architectures=("Gemma2ForCausalLM",),
    )
    yield ModelArchitectureSpec(
        name="gemma3", summary="Gemma 3 text (q/k norms, a RoPE table per layer type, sliding windows)",
        load=lazy_import(__name__, ".gemma2", "Gemma3ForCausalLM"), architectures=("Gemma3ForCausalLM",),
    )
    yield ModelArchitectureSpec(
        name="phi3", summary="Phi-3 / Phi-4-mini (fused qkv and gate_up checkpoints, LongRoPE, partial RoPE)",
        load=lazy_import(__name__, ".phi3", "Phi3ForCausalLM"), architectures=("Phi3ForCausalLM",),
    )
