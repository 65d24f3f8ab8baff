"""Mixtral: the Mistral decoder whose feed-forward is a sparse mixture of experts.

Each layer's ``block_sparse_moe`` routes every token to ``num_experts_per_tok`` of
``num_local_experts`` SiLU experts (checkpoint ``experts.N.w1`` gate, ``w3`` up, ``w2`` down),
softmax then top-k renormalised to sum to 1, weights kept in float32 (transformers' order); the
experts run fused (``loom.layers.fused_moe``). A sliding window, when the config sets one, applies
to every layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from loom.layers.fused_moe import SparseMoeBlock

from .llama import LlamaForCausalLM, LlamaVariant

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from loom.plugin_api.quantization import QuantizationConfig


def require_silu(config: PretrainedConfig) -> None:
    if config.hidden_act != "silu":
        raise ValueError(f"unsupported hidden_act {config.hidden_act!r} for the experts (only 'silu')")


class MixtralForCausalLM(LlamaForCausalLM):
    @classmethod
    def variant(cls, config: PretrainedConfig) -> LlamaVariant:
        return LlamaVariant(sliding_window_rule="all", mlp_name="block_sparse_moe")

    @classmethod
    def build_mlp(cls, config: PretrainedConfig, layer_idx: int, quant_config: QuantizationConfig | None,
                  prefix: str) -> nn.Module:
        require_silu(config)
        return SparseMoeBlock(int(config.num_local_experts), int(config.num_experts_per_tok),
                              int(config.hidden_size), int(config.intermediate_size), renormalize=True,
                              checkpoint_names=("w1", "w3", "w2"), quant_config=quant_config, prefix=prefix)
