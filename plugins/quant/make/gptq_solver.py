"""GPTQ (Frantar et al., IST-DASLab): quantize a weight column by column, spreading each column's
rounding error over the columns not yet quantized, weighted by the inverse Hessian of the
layer's calibration inputs, so that ``||W X - Q X||`` (not ``||W - Q||``) stays small.

``H = 2/n sum x x^T`` over the n calibration inputs ``x [in]`` (:class:`HessianAccumulator`).
Inputs never active (``H[d, d] = 0``) get ``H[d, d] = 1`` and a zero weight column. Act-order
quantizes the inputs by decreasing ``H[d, d]`` (the most active first, while the most error can
still be compensated) and records each input's group in ``g_idx``. ``H`` is damped by
``damp * mean(diag H)``; the Cholesky factor (upper) of ``H^-1`` gives the error-propagation
rows. Columns go in blocks of 128: within a block the error of each column updates the block's
remaining columns at once, and each finished block updates all later columns in one matmul.
"""

from __future__ import annotations

import torch

from .group_quant import QuantizedLinear, dequantize_codes, find_params, group_size_of, quantize_codes

BLOCK = 128


class HessianAccumulator:
    """``H = 2/n sum x x^T`` over the inputs a linear layer sees (in float64: n is thousands)."""

    def __init__(self, in_features: int) -> None:
        self.in_features = in_features
        self.h: torch.Tensor | None = None  # on the device of the first inputs added
        self.n = 0

    def add(self, x: torch.Tensor) -> None:  # x [..., in]
        flat = x.reshape(-1, x.shape[-1]).double()
        if self.h is None:
            self.h = torch.zeros(self.in_features, self.in_features, dtype=torch.float64, device=flat.device)
        self.h += flat.t() @ flat
        self.n += flat.shape[0]

    def hessian(self) -> torch.Tensor:
        if self.h is None:
            return torch.zeros(self.in_features, self.in_features, dtype=torch.float64)
        return (2.0 / max(self.n, 1)) * self.h


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int, sym: bool,
                  act_order: bool, damp: float = 0.01, min_zero: int = 0) -> QuantizedLinear:
    """``weight [out, in]`` quantized with GPTQ against ``hessian [in, in]``, on their device."""
    w = weight.float().clone()
    dev = w.device
    out_f, in_f = w.shape
    h = hessian.to(dev, torch.float64, copy=True)
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(in_f, device=dev)
    w, h = w[:, perm], h[perm][:, perm]
    h += damp * torch.mean(torch.diag(h)) * torch.eye(in_f, dtype=h.dtype, device=dev)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()

    gs = group_size_of(group_size, in_f)
    block = max(BLOCK // gs, 1) * gs if gs <= BLOCK else gs  # whole groups per block
    codes = torch.zeros(out_f, in_f, dtype=torch.int64, device=dev)
    scales, zeros = [], []
    params = find_params(w, bits, sym, min_zero) if group_size == -1 else None
    for i1 in range(0, in_f, block):
        i2 = min(i1 + block, in_f)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if group_size != -1 and col % gs == 0:  # a new group: its parameters from the updated weights
                params = find_params(w1[:, i:i + gs], bits, sym, min_zero)
                scales.append(params.scale)
                zeros.append(params.zero)
            assert params is not None
            q = quantize_codes(w1[:, i:i + 1], params, bits)  # [out, 1]
            codes[:, col] = q[:, 0].long()
            err = (w1[:, i:i + 1] - dequantize_codes(q, params)) / hinv1[i, i]
            w1[:, i:] -= err @ hinv1[i:i + 1, i:]
            err1[:, i:i + 1] = err
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    if group_size == -1:
        assert params is not None
        scales, zeros = [params.scale], [params.zero]
    # Back to the layer's input order: input perm[c] was quantized c-th, in group c // gs.
    inverse = torch.argsort(perm)
    g_idx = torch.empty(in_f, dtype=torch.int32, device=dev)
    g_idx[perm] = (torch.arange(in_f, device=dev) // gs).to(torch.int32)
    return QuantizedLinear(codes[:, inverse], torch.cat(scales, 1), torch.cat(zeros, 1).long(), g_idx, bits)
