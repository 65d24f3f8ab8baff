"""The contract of a Mixture-of-Experts quantization method: how one layer's experts keep and
apply their weights.

It mirrors :class:`loom.plugin_api.quantization.LinearMethod`, for the stacked experts of a
:class:`loom.layers.fused_moe.FusedMoE` layer instead of one matrix:

1. ``create_weights``: register the layer's expert parameters. Their names start with ``w13_``
   (the gate and up projections of every expert, stacked: ``w13_weight [E, 2 * I, H]``, gate
   rows first) or ``w2_`` (the down projections: ``w2_weight [E, H, I]``). The layer maps a
   checkpoint's per-expert tensors onto them by that prefix: ``experts.3.gate_proj.<p>`` loads
   into ``w13_<p>`` (expert 3, part 0), ``experts.3.up_proj.<p>`` into ``w13_<p>`` (part 1),
   ``experts.3.down_proj.<p>`` into ``w2_<p>``; so a method that stores ``qweight`` and
   ``scales`` registers ``w13_qweight``, ``w13_scales``, ``w2_qweight``, ``w2_scales``. Each
   parameter gets the layer's ``weight_loader`` and the sharding hints of ``loom.layers.linear``
   counted *without* the leading expert dimension (``output_dim`` for w13, ``input_dim`` for
   w2; ``packed_dim`` / ``packed_factor`` likewise).
2. the model's ``load_weights`` streams checkpoint tensors in;
3. ``process_weights_after_loading``: repack for a kernel;
4. ``apply``: the experts' part of the layer's forward: every token's ``top_k`` experts,
   weighted by its routing weights and summed.

A quantization config serves MoE layers by defining ``get_moe_method(layer, prefix)``
(returning None keeps the dense experts); configs without it leave every MoE layer dense.
The router (``gate``) is a plain linear layer and stays dense.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from .quantization import WeightLoader


class FusedMoEMethod(ABC):
    """How one MoE layer keeps and runs its experts. One instance may serve many layers."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        """Register the layer's ``w13_*`` and ``w2_*`` parameters (this rank's slice of the
        intermediate dimension)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 - optional hook
        """Called once every checkpoint tensor is in (default: nothing)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, ``topk_weights [T, k]``, ``topk_ids [T, k]`` (int) -> ``[T, H]``:
        ``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` on this rank (the layer
        sums over ranks)."""
