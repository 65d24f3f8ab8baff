"""Gated activations applied to a fused ``gate_up`` projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` where the input holds ``[gate | up]`` along the last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2*I] -> [T, I]
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
