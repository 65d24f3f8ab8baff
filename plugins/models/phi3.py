"""Phi-3 (and Phi-3.5-mini, Phi-4-mini): the Llama decoder, its checkpoint already fused.

The checkpoint stores ``self_attn.qkv_proj`` (``[q | k | v]`` rows) and ``mlp.gate_up_proj``
(``[gate | up]`` rows) as single tensors: they load whole into Loom's fused layers, whose
loaders split them into parts (and into this rank's slice of each). RoPE: default or LongRoPE
(``longrope``, ``su``: short factors below ``original_max_position_embeddings``, long ones from
there on; see ``loom.layers.rotary``), on the first ``partial_rotary_factor`` of each head
(Phi-4-mini rotates three quarters). A sliding window, when the config sets one, applies to
every layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from .llama import LlamaForCausalLM, LlamaVariant

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Phi3ForCausalLM(LlamaForCausalLM):
    # Nothing to map: the checkpoint's names are the fused modules' own.
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {}

    @classmethod
    def variant(cls, config: PretrainedConfig) -> LlamaVariant:
        return LlamaVariant(sliding_window_rule="all")
