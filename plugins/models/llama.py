"""Llama-family decoder with fused projections: Llama and Mistral here, Qwen2/Qwen3 subclass it.

Flat token layout: ``forward`` takes ``input_ids [T]`` and ``positions [T]`` of every sequence in
the step at once; which token belongs to which sequence only matters inside the attention
backend, through the step's forward context.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from loom.layers.activation import SiluAndMul
from loom.layers.attention import Attention
from loom.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from loom.layers.fused_moe import SparseMoeBlock
from loom.layers.fused_moe_triton import ExpertOutputs
from loom.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from loom.layers.norm import RMSNorm
from loom.layers.quantized_input import feed
from loom.layers.rotary import PendingRope, RotaryEmbedding, get_rope
from loom.model_loader.hf_config import SlidingWindowRule, head_dim_of, layer_sliding_windows, num_kv_heads_of

from .weights import load_packed_weights

if TYPE_CHECKING:
    from collections.abc import Iterable

    from transformers import PretrainedConfig

    from loom.plugin_api.quantization import QuantizationConfig, QuantizedRows


@dataclass(frozen=True)
class LlamaVariant:
    """What differs between the members of the family."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    sliding_window_rule: SlidingWindowRule = "none"
    mlp_name: str = "mlp"  # the feed-forward module's name in the checkpoint (Mixtral: block_sparse_moe)


# (config, layer index, quantization config, prefix) -> the layer's feed-forward module, [T, H] -> [T, H]
MlpFactory = Callable[["PretrainedConfig", int, "QuantizationConfig | None", str], nn.Module]


class LlamaAttentionBlock(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int, variant: LlamaVariant,
                 sliding_window: int | None, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        hidden = int(config.hidden_size)
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, int(config.num_attention_heads),
                                          num_kv_heads_of(config), bias=variant.qkv_bias,
                                          quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        # This rank's heads (all of them with one rank).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(int(config.num_attention_heads) * self.head_dim, hidden,
                                        bias=variant.o_bias, quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if variant.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim,
                              self.head_dim**-0.5, sliding_window)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor | QuantizedRows,
                rotary: RotaryEmbedding) -> torch.Tensor:  # [T, H] (dense or quantized for qkv) -> [T, H]
        T = positions.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, (Hq + 2*Hkv) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        # RoPE (after Qwen3's per-head norms) is applied by the attention layer: on CUDA in the
        # kernel that writes K/V into the pool
        rope = PendingRope(rotary, positions, self.q_norm, self.k_norm)
        out = self.attn(q.reshape(T, self.q_size), k.reshape(T, self.kv_size), v, rope)  # [T, Hq*D]
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, bias: bool, quant_config: QuantizationConfig | None,
                 prefix: str) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (only 'silu')")
        hidden, inter = int(config.hidden_size), int(config.intermediate_size)
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias=bias, quant_config=quant_config,
                                                       prefix=f"{prefix}.gate_up_proj")  # [gate | up]
        self.down_proj = RowParallelLinear(inter, hidden, bias=bias, quant_config=quant_config,
                                           prefix=f"{prefix}.down_proj")
        self.act_fn = SiluAndMul()
        feed(self.act_fn, self.down_proj)  # FP8: the activation quantizes down's input in its kernel

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:  # [T, H] (dense or quantized) -> [T, H]
        return self.down_proj(self.act_fn.forward_for_linear(self.gate_up_proj(x)))


def llama_mlp(config: PretrainedConfig, layer_idx: int, quant_config: QuantizationConfig | None,
              prefix: str) -> nn.Module:
    return LlamaMLP(config, bool(getattr(config, "mlp_bias", False)), quant_config, prefix)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int, variant: LlamaVariant,
                 sliding_window: int | None, quant_config: QuantizationConfig | None, prefix: str,
                 mlp_factory: MlpFactory = llama_mlp) -> None:
        super().__init__()
        self.self_attn = LlamaAttentionBlock(config, layer_idx, variant, sliding_window, quant_config,
                                             f"{prefix}.self_attn")
        # Registered under the checkpoint's name for it ("mlp", or Mixtral's "block_sparse_moe").
        self.mlp_name = variant.mlp_name
        self.add_module(self.mlp_name, mlp_factory(config, layer_idx, quant_config, f"{prefix}.{self.mlp_name}"))
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # Each norm's output is one projection's whole input: with FP8 layers the norm's kernel
        # quantizes it for them (loom.layers.quantized_input; the same codes, one pass fewer).
        feed(self.input_layernorm, self.self_attn.qkv_proj)
        mlp = getattr(self, self.mlp_name)
        if isinstance(mlp, LlamaMLP):
            feed(self.post_attention_layernorm, mlp.gate_up_proj)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor | ExpertOutputs, residual: torch.Tensor | None,
                rotary: RotaryEmbedding) -> tuple[torch.Tensor | ExpertOutputs, torch.Tensor]:
        """``(hidden, residual) -> (mlp output, residual)``, all ``[T, H]``.

        The residual stream is carried alongside rather than added at the end of the layer: each
        add is done by the norm that follows it (``forward_with_residual``: one fused kernel on
        CUDA). The adds and norms are HF's, in HF's order and dtype, so the results are the same
        bits as ``h = h + attn(norm1(h)); h = h + mlp(norm2(h))``. ``residual`` is None for the
        first layer, whose ``hidden`` is the embedding output. A mixture of experts may hand its
        output on as its experts' rows (``ExpertOutputs``), which that norm sums before its add,
        and takes the post-attention norm in (``SparseMoeBlock.forward_with_norm``), which may run
        it in its router's launch.
        """
        if residual is None and not isinstance(hidden, torch.Tensor):
            raise TypeError("the first layer takes the embedding output")
        normed, residual = self.input_layernorm.forward_for_linear(hidden, residual)
        attn_out = self.self_attn(positions, normed, rotary)
        mlp: nn.Module = getattr(self, self.mlp_name)
        if isinstance(mlp, SparseMoeBlock):
            # The block runs this norm itself (on CUDA at decode sizes in its router's launch) and
            # hands its experts' rows on unsummed: the next norm sums them. One launch fewer each.
            return mlp.forward_with_norm(attn_out, residual, self.post_attention_layernorm)
        if isinstance(mlp, LlamaMLP):
            mlp_in, residual = self.post_attention_layernorm.forward_for_linear(attn_out, residual)
            return mlp(mlp_in), residual
        hidden, residual = self.post_attention_layernorm.forward_with_residual(attn_out, residual)
        return mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, variant: LlamaVariant, quant_config: QuantizationConfig | None,
                 prefix: str = "model", mlp_factory: MlpFactory = llama_mlp) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   prefix=f"{prefix}.embed_tokens")
        windows = layer_sliding_windows(config, variant.sliding_window_rule)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, variant, windows[i], quant_config, f"{prefix}.layers.{i}", mlp_factory)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = get_rope(config, head_dim_of(config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden: torch.Tensor | ExpertOutputs = self.embed_tokens(input_ids)  # [T, H]
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, self.rotary_emb)
        if residual is None:  # no layers
            assert isinstance(hidden, torch.Tensor)
            return self.norm(hidden)
        return self.norm.forward_with_residual(hidden, residual)[0]  # the last layer's add, fused


class LlamaForCausalLM(nn.Module):
    """The model contract the engine relies on: forward, compute_logits, load_weights."""

    # fused parameter -> the checkpoint modules whose rows it holds, in order (shard ids 0, 1, ...)
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    @classmethod
    def variant(cls, config: PretrainedConfig) -> LlamaVariant:
        bias = bool(getattr(config, "attention_bias", False))
        return LlamaVariant(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)))

    @classmethod
    def build_mlp(cls, config: PretrainedConfig, layer_idx: int, quant_config: QuantizationConfig | None,
                  prefix: str) -> nn.Module:
        """Layer ``layer_idx``'s feed-forward module (a subclass may return a mixture of experts)."""
        return LlamaMLP(config, cls.variant(config).mlp_bias, quant_config, prefix)

    def __init__(self, config: PretrainedConfig, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.variant(config), quant_config, mlp_factory=self.build_mlp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # Tied: the logits reuse the embedding matrix, so no second [V, H] tensor is allocated
        # (a quantization method may still give the head quantized weights of its own).
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=quant_config,
                                      tied=self.model.embed_tokens if self.tie_word_embeddings else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids [T], positions [T] (int64) -> final-normed hidden states [T, H]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, V] float32
        logits: torch.Tensor = self.lm_head(hidden)
        return logits.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hand each HF-named checkpoint tensor to its parameter's loader; refuse unknown names."""
        skip = {"lm_head.weight"} if self.tie_word_embeddings else set()
        load_packed_weights(self, weights, self.packed_modules_mapping, skip)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is Llama with an optional sliding window on every layer and no biases."""

    @classmethod
    def variant(cls, config: PretrainedConfig) -> LlamaVariant:
        return LlamaVariant(sliding_window_rule="all")
