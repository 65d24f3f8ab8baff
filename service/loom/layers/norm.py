"""RMSNorm, numerically identical to Hugging Face's Llama/Qwen implementation.

On CUDA (with triton, unless ``LOOM_FUSED_KERNELS=0``) one fused kernel does the whole norm, and
``forward_with_residual`` also folds in the residual add that precedes it (and, after an MoE layer
that returned its experts' rows unsummed, that layer's weighted sum); on the CPU in float32
one C++ operator does the same (``cpu_fused``); elsewhere the torch code below runs, which is the
reference the kernels reproduce.
"""

from __future__ import annotations

import torch
from torch import nn

from loom.layers import cpu_fused, fused_ops, quantized_input
from loom.layers.fused_moe_triton import ExpertOutputs
from loom.plugin_api.quantization import QuantizedRows, RowQuantization


class RMSNorm(nn.Module):
    """``weight * normalise(x)`` over the last dimension.

    Statistics are computed in float32 and the normalised value is cast back to the input dtype
    *before* the weight multiply, exactly as HF does, so half-precision outputs round the same way.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        if fused_ops.norm_supported(x, self.weight):
            return fused_ops.fused_add_rms_norm(x, None, self.weight, self.eps)[0]
        if cpu_fused.norm_supported(x, self.weight):
            return cpu_fused.add_rms_norm(x, None, self.weight, self.eps)[0]
        return self._forward_torch(x)

    def forward_for_linear(self, x: torch.Tensor | ExpertOutputs,
                           residual: torch.Tensor | None) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
        """``(norm(h), h)`` with ``h = residual + x`` (``x`` without a residual), where ``norm(h)`` is
        the whole input of the linear layer this norm feeds (``quantized_input.feed``): quantized
        here, in the norm's kernel, when that layer would quantize it first (FP8), else dense."""
        if isinstance(x, torch.Tensor):
            how = quantized_input.wanted(self, x.shape[0], x.dtype) if x.dim() == 2 else None
            if how is not None:
                return self._quantized(x, residual, how)
        if residual is None:
            if not isinstance(x, torch.Tensor):
                raise TypeError("an MoE layer's expert rows need the residual they are added to")
            return self(x), x
        return self.forward_with_residual(x, residual)

    def _quantized(self, x: torch.Tensor, residual: torch.Tensor | None,
                   how: RowQuantization) -> tuple[QuantizedRows, torch.Tensor]:
        if fused_ops.norm_supported(x, self.weight, residual):
            codes, scales, h = fused_ops.fused_add_rms_norm_quant(x, residual, self.weight, self.eps, how.static_scale)
            return QuantizedRows(codes, scales, x.dtype), h
        normed, h = (self(x), x) if residual is None else self.forward_with_residual(x, residual)
        return quantized_input.quantize(normed, how), h

    def forward_with_residual(self, x: torch.Tensor | ExpertOutputs,
                              residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``h = residual + x``, then ``(norm(h), h)``: the residual stream's add, fused into the
        norm that follows it (x, residual: ``[T, H]``; ``h`` is the next residual).

        ``x`` may be an MoE layer's expert rows not yet summed (``SparseMoeBlock.forward_uncombined``):
        one kernel then sums them too, with the same roundings as the layer's own combine."""
        if isinstance(x, ExpertOutputs):
            if fused_ops.combine_norm_supported(x.rows, x.weights, self.weight, residual):
                return fused_ops.fused_combine_add_rms_norm(x.rows, x.weights, residual, self.weight, self.eps)
            x = x.combine()
        if fused_ops.norm_supported(x, self.weight, residual):
            return fused_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if cpu_fused.norm_supported(x, self.weight, residual):
            return cpu_fused.add_rms_norm(x, residual, self.weight, self.eps)
        h = residual + x
        return self(h), h

    def _forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        return self.weight * h.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``normalise(x) * (1 + weight)``, all in float32, cast back at the end.

    The checkpoint stores ``weight`` as an offset from 1 (zeros are the identity). Unlike
    :class:`RMSNorm`, transformers multiplies by the weight *before* casting to the input dtype;
    this matches it (the torch path on every device).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
