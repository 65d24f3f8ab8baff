"""The model contract: what a ``loom_model_architectures`` plugin's ``load()`` returns.

A model class is built as ``cls(hf_config, quant_config)`` on the target device (the loader sets
the default device and dtype), with Loom's layers (``loom.layers``: linears that load
themselves, attention that reads the step's forward context, a vocab-parallel embedding and
head). It never sees the batch: a step is one flat run of tokens, ``input_ids [T]`` and
``positions [T]``, and the attention layers find the step's metadata and KV pool in the forward
context the model runner sets.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar, Protocol

if TYPE_CHECKING:
    import torch


class CausalLM(Protocol):
    """What the engine needs of a model plugin's module (see plugins/models/llama.py)."""

    # fused parameter -> the checkpoint modules whose rows it holds, in order (e.g. "qkv_proj":
    # ["q_proj", "k_proj", "v_proj"]); quantization methods read it to match packed tensors.
    packed_modules_mapping: ClassVar[dict[str, list[str]]]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[T] int64 token ids, [T] int64 positions -> [T, hidden] final-normed hidden states."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hand each checkpoint tensor (Hugging Face names) to its parameter's weight loader;
        refuse names the model does not know."""
