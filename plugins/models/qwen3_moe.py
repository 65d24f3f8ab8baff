"""Qwen3-MoE: the Qwen3 decoder (q/k RMSNorm) whose feed-forward is a sparse mixture of experts.

A layer is sparse unless it is listed in ``mlp_only_layers`` or falls between two
``decoder_sparse_step``s (``(i + 1) % step != 0``); those keep a dense SiLU MLP of
``intermediate_size``. A sparse layer routes each token to ``num_experts_per_tok`` of
``num_experts`` experts of ``moe_intermediate_size`` (checkpoint ``mlp.experts.N.gate_proj /
up_proj / down_proj``): softmax in float32, top-k, renormalised only with ``norm_topk_prob``, the
weights cast to the activation dtype (transformers' order). No shared expert.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from loom.layers.fused_moe import SparseMoeBlock

from .llama import LlamaForCausalLM, LlamaMLP, LlamaVariant
from .mixtral import require_silu

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from loom.plugin_api.quantization import QuantizationConfig


def is_sparse_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    """transformers' rule for which Qwen3-MoE layers have experts."""
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and int(config.num_experts) > 0 and (layer_idx + 1) % step == 0)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    @classmethod
    def variant(cls, config: PretrainedConfig) -> LlamaVariant:
        bias = bool(getattr(config, "attention_bias", False))
        # transformers 5 drops sliding_window unless use_sliding_window; when set, every layer slides.
        return LlamaVariant(qkv_bias=bias, o_bias=bias, qk_norm=True, sliding_window_rule="all")

    @classmethod
    def build_mlp(cls, config: PretrainedConfig, layer_idx: int, quant_config: QuantizationConfig | None,
                  prefix: str) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return LlamaMLP(config, False, quant_config, prefix)
        require_silu(config)
        return SparseMoeBlock(int(config.num_experts), int(config.num_experts_per_tok), int(config.hidden_size),
                              int(config.moe_intermediate_size),
                              renormalize=bool(getattr(config, "norm_topk_prob", False)),
                              weights_in_logits_dtype=True, quant_config=quant_config, prefix=prefix)
