"""Qwen3: the Llama decoder with per-head RMSNorm on q and k before RoPE.

``head_dim`` comes from the config (it is not hidden_size / num_heads for most Qwen3 sizes);
biases follow ``attention_bias`` on all four projections, as in HF.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .llama import LlamaForCausalLM, LlamaVariant

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def variant(cls, config: PretrainedConfig) -> LlamaVariant:
        bias = bool(getattr(config, "attention_bias", False))
        return LlamaVariant(qkv_bias=bias, o_bias=bias, qk_norm=True, sliding_window_rule="per_layer")
