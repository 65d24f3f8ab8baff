"""Gemma 2, and Gemma 3's text model: a decoder with four norms per layer and capped logits.

What differs from Llama, as transformers computes it:

* the embedding output is multiplied by ``sqrt(hidden_size)``, that constant first rounded to
  the model's dtype;
* every norm is Gemma's RMSNorm, ``normalise(x) * (1 + weight)`` in float32; a layer has four:
  before attention, after attention (on its output, before the residual add), before the MLP
  and after the MLP;
* attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` (not ``head_dim ** -0.5``)
  and, in Gemma 2, soft-capped: ``cap * tanh(score / cap)`` with ``attn_logit_softcapping``
  (the attention backend does it: torch, paged and flash implement it);
* layers alternate between a sliding window and the full context (``layer_types``);
* the MLP is ``gelu_tanh(gate) * up``;
* the logits are soft-capped too (``final_logit_softcapping``; computed here in float32 on the
  head's output, where transformers caps in the model's dtype: identical in float32);
* the logits head is tied to the embedding.

Gemma 3 (``Gemma3ForCausalLM``, model type ``gemma3_text``) adds Gemma-style RMSNorm on each
head of q and k before RoPE, uses one RoPE table for the sliding layers and another for the
global ones (its ``rope_parameters`` per layer type), and by default caps nothing. Gemma 3's
bidirectional-attention variant (``use_bidirectional_attention``, for embeddings) is refused.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from loom.layers.activation import GeluTanhAndMul
from loom.layers.attention import Attention
from loom.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from loom.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from loom.layers.norm import GemmaRMSNorm
from loom.layers.rotary import PendingRope, RotaryEmbedding, get_rope
from loom.model_loader.hf_config import head_dim_of, layer_sliding_windows, num_kv_heads_of

from .weights import load_packed_weights

if TYPE_CHECKING:
    from collections.abc import Iterable

    from transformers import PretrainedConfig

    from loom.plugin_api.quantization import QuantizationConfig

_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


class GemmaAttentionBlock(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int, sliding_window: int | None, qk_norm: bool,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        hidden = int(config.hidden_size)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, int(config.num_attention_heads), num_kv_heads_of(config),
                                          bias=bias, quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(int(config.num_attention_heads) * self.head_dim, hidden, bias=bias,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.q_norm: GemmaRMSNorm | None = None
        self.k_norm: GemmaRMSNorm | None = None
        if qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        cap = getattr(config, "attn_logit_softcapping", None)
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim,
                              float(config.query_pre_attn_scalar) ** -0.5, sliding_window,
                              logits_soft_cap=float(cap) if cap else None)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                rotary: RotaryEmbedding) -> torch.Tensor:  # [T, H] -> [T, H]
        T = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(T, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.reshape(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        rope = PendingRope(rotary, positions, self.q_norm, self.k_norm)  # applied by the attention layer
        return self.o_proj(self.attn(q.reshape(T, self.q_size), k.reshape(T, self.kv_size), v, rope))


class GemmaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if act not in _GELU_TANH:
            raise ValueError(f"unsupported hidden_activation {act!r} (only {' or '.join(_GELU_TANH)})")
        hidden, inter = int(config.hidden_size), int(config.intermediate_size)
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias=False, quant_config=quant_config,
                                                       prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(inter, hidden, bias=False, quant_config=quant_config,
                                           prefix=f"{prefix}.down_proj")
        self.act_fn = GeluTanhAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int, sliding_window: int | None, qk_norm: bool,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.self_attn = GemmaAttentionBlock(config, layer_idx, sliding_window, qk_norm, quant_config,
                                             f"{prefix}.self_attn")
        self.mlp = GemmaMLP(config, quant_config, f"{prefix}.mlp")
        hidden, eps = int(config.hidden_size), float(config.rms_norm_eps)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                rotary: RotaryEmbedding) -> torch.Tensor:  # [T, H] -> [T, H]
        attn = self.self_attn(positions, self.input_layernorm(hidden), rotary)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


def _rope_for(config: PretrainedConfig, head_dim: int, layer_type: str) -> RotaryEmbedding:
    """The RoPE table of one layer type: per-layer-type parameters (transformers 5), or a flat
    config whose sliding layers use ``rope_local_base_freq`` (transformers 4's Gemma 3)."""
    params = getattr(config, "rope_parameters", None)
    per_type = isinstance(params, dict) and any(isinstance(v, dict) for v in params.values())
    local_base = getattr(config, "rope_local_base_freq", None)
    if layer_type == "sliding_attention" and local_base is not None and not per_type:
        local = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": float(local_base)},
                                max_position_embeddings=config.max_position_embeddings)
        return get_rope(local, head_dim)
    return get_rope(config, head_dim, layer_type=layer_type)


class GemmaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, qk_norm: bool, rope_per_layer_type: bool,
                 quant_config: QuantizationConfig | None, prefix: str = "model") -> None:
        super().__init__()
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention (Gemma embedding models) is not supported: "
                             "Loom serves causal language models")
        hidden = int(config.hidden_size)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, prefix=f"{prefix}.embed_tokens")
        # transformers multiplies by sqrt(hidden) rounded to the embedding's dtype first.
        self.embed_scale = float(torch.tensor(hidden**0.5, dtype=self.embed_tokens.weight.dtype))
        windows = layer_sliding_windows(config, "per_layer")
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i, windows[i], qk_norm, quant_config, f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(hidden, float(config.rms_norm_eps))
        head_dim = head_dim_of(config)
        layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
        if rope_per_layer_type:
            self.rotary = nn.ModuleDict({t: _rope_for(config, head_dim, t) for t in sorted(set(layer_types))})
            self.layer_rotary = list(layer_types)
        else:
            self.rotary = nn.ModuleDict({"all": get_rope(config, head_dim)})
            self.layer_rotary = ["all"] * len(layer_types)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        hidden = self.embed_tokens(input_ids) * self.embed_scale
        for layer, rope in zip(self.layers, self.layer_rotary, strict=True):
            hidden = layer(positions, hidden, self.rotary[rope])
        return self.norm(hidden)


class Gemma2ForCausalLM(nn.Module):
    """The model contract: forward, compute_logits, load_weights."""

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    qk_norm: ClassVar[bool] = False
    rope_per_layer_type: ClassVar[bool] = False

    def __init__(self, config: PretrainedConfig, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = GemmaModel(config, self.qk_norm, self.rope_per_layer_type, quant_config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=quant_config,
                                      tied=self.model.embed_tokens if self.tie_word_embeddings else None)
        cap = getattr(config, "final_logit_softcapping", None)
        self.final_logit_softcapping: float | None = float(cap) if cap else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids [T], positions [T] (int64) -> final-normed hidden states [T, H]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] float32
        logits: torch.Tensor = self.lm_head(hidden).float()
        if self.final_logit_softcapping is not None:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        skip = {"lm_head.weight"} if self.tie_word_embeddings else set()
        load_packed_weights(self, weights, self.packed_modules_mapping, skip)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's text model: q/k norms, a RoPE table per layer type, no caps by default."""

    qk_norm = True
    rope_per_layer_type = True
