"""Qwen2: the Llama decoder with biases on the q/k/v projections (not on o_proj)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .llama import LlamaForCausalLM, LlamaVariant

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def variant(cls, config: PretrainedConfig) -> LlamaVariant:
        # Sliding windows, when enabled, apply per layer (layer_types / max_window_layers).
        return LlamaVariant(qkv_bias=True, o_bias=False, sliding_window_rule="per_layer")
