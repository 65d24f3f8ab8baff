"""Integer quantization of a weight's rows in groups of inputs: scales, zero points, codes.

For ``b`` bits (``maxq = 2^b - 1``) and a group of inputs ``x`` of one output row: symmetric uses
``scale = 2 max|x| / maxq`` and zero ``(maxq + 1) / 2``; asymmetric ``scale = (max - min) / maxq``
(the range widened to include 0) and ``zero = round(-min / scale)``. Scales are rounded to
float16 before any code is computed, because the checkpoint stores them in float16: a code is
the nearest step of the scale the reader will use. ``q = clamp(round(x / scale) + zero, 0, maxq)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GroupParams:
    scale: torch.Tensor  # [out, 1] float32 (float16 values)
    zero: torch.Tensor  # [out, 1] float32 (integers)


def find_params(w: torch.Tensor, bits: int, sym: bool, min_zero: int = 0) -> GroupParams:
    """Parameters for each row of ``w [out, n]`` (one group); ``min_zero``: the smallest zero point
    the format can store (GPTQ v1 stores zero - 1, so asymmetric zeros start at 1)."""
    maxq = (1 << bits) - 1
    lo = w.min(dim=1, keepdim=True).values.clamp(max=0)
    hi = w.max(dim=1, keepdim=True).values.clamp(min=0)
    if sym:
        top = torch.maximum(lo.abs(), hi).clamp(min=1e-8)
        scale = (2 * top / maxq).half().float()
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        scale = ((hi - lo).clamp(min=1e-8) / maxq).half().float()
        zero = torch.round(-lo / scale).clamp(min_zero, maxq)
    return GroupParams(scale=scale.clamp(min=float(torch.finfo(torch.float16).tiny)), zero=zero)


def quantize_codes(w: torch.Tensor, params: GroupParams, bits: int) -> torch.Tensor:
    """``w [out, n]`` -> codes ``[out, n]`` (float32 integers in ``[0, 2^bits)``)."""
    return torch.clamp(torch.round(w / params.scale) + params.zero, 0, (1 << bits) - 1)


def dequantize_codes(q: torch.Tensor, params: GroupParams) -> torch.Tensor:
    return (q - params.zero) * params.scale


@dataclass
class QuantizedLinear:
    """A linear layer's quantization, in the input order of the layer."""

    codes: torch.Tensor  # [out, in] int64 in [0, 2^bits)
    scales: torch.Tensor  # [out, G] float32 (float16 values)
    zeros: torch.Tensor  # [out, G] int64
    g_idx: torch.Tensor  # [in] int32: each input's group
    bits: int

    def to(self, device: torch.device | str) -> QuantizedLinear:
        return QuantizedLinear(self.codes.to(device), self.scales.to(device), self.zeros.to(device),
                               self.g_idx.to(device), self.bits)

    def dequantize(self) -> torch.Tensor:  # [out, in] float32
        g = self.g_idx.long()
        return (self.codes - self.zeros[:, g]).float() * self.scales[:, g]


def group_size_of(group_size: int, in_features: int) -> int:
    return in_features if group_size == -1 else group_size


def rtn(w: torch.Tensor, bits: int, group_size: int, sym: bool, min_zero: int = 0) -> QuantizedLinear:
    """Round to nearest, group by group: the floor GPTQ and AWQ improve on. All groups at once on
    ``w``'s device (a random model's layers are quantized this way while they load on the GPU)."""
    out_f, in_f = w.shape
    gs = group_size_of(group_size, in_f)
    groups = in_f // gs
    rows = w.float().reshape(out_f * groups, gs)  # one row per (output, group)
    params = find_params(rows, bits, sym, min_zero)
    codes = quantize_codes(rows, params, bits).to(torch.int64).view(out_f, in_f)
    g_idx = (torch.arange(in_f, device=w.device) // gs).to(torch.int32)
    return QuantizedLinear(codes, params.scale.view(out_f, groups), params.zero.view(out_f, groups).long(), g_idx,
                           bits)
