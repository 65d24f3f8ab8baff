"""Gated activations applied to a fused ``gate_up`` projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom.layers import cpu_fused, fused_ops, quantized_input
from loom.plugin_api.quantization import QuantizedRows


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` where the input holds ``[gate | up]`` along the last dimension."""

    def forward_for_linear(self, x: torch.Tensor) -> torch.Tensor | QuantizedRows:  # [T, 2*I] -> [T, I]
        """The output, when it is the whole input of the linear layer this feeds
        (``quantized_input.feed``): quantized here, in the same kernel, when that layer would
        quantize it first (FP8), else dense."""
        how = quantized_input.wanted(self, x.numel() // x.shape[-1] if x.shape[-1] else 0, x.dtype)
        if how is None:
            return self(x)
        if fused_ops.silu_and_mul_supported(x):
            codes, scales = fused_ops.silu_and_mul_quant(x, how.static_scale)
            return QuantizedRows(codes, scales, x.dtype)
        return quantized_input.quantize(self(x), how)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2*I] -> [T, I]
        if fused_ops.silu_and_mul_supported(x):  # CUDA: one kernel instead of three
            return fused_ops.silu_and_mul(x)
        if cpu_fused.silu_and_mul_supported(x):  # CPU float32: one C++ operator
            return cpu_fused.silu_and_mul(x)
        d = x.shape[-1] // 2
        # in place on silu's fresh output: one [T, I] allocation fewer, the same rounding
        return F.silu(x[..., :d]).mul_(x[..., d:])


class GeluTanhAndMul(nn.Module):
    """``gelu_tanh(gate) * up`` (transformers' ``gelu_pytorch_tanh``: Gemma) on ``[gate | up]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2*I] -> [T, I]
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate="tanh").mul_(x[..., d:])
