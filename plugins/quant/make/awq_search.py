"""AWQ (Lin et al., MIT HAN lab): protect the weights that multiply large activations by scaling
input channels before quantizing, with the inverse scale folded into the layer before.

For a group of linears reading the same input ``x`` (q/k/v after the input norm; gate/up after
the post-attention norm; down after up; o after v when their shapes allow), each input channel
gets ``s = mean|x|^a / mean|w~|^(1 - a)`` (``w~``: the weights normalised by their group's max),
``a`` on a grid of 20 in ``[0, 1)``, normalised by ``sqrt(max s * min s)``. The grid point kept
minimises ``||Q(W diag(s)) (x / s) - W x||^2`` on the calibration activations. Then ``W <- W
diag(s)`` and the previous norm's weight (or the previous linear's rows) are divided by ``s``:
the float model computes the same function, and quantization error lands on smaller weights.
"""

from __future__ import annotations

import torch

from .group_quant import rtn

GRID = 20


def fake_quantize(w: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    return rtn(w, bits, group_size, sym=False).dequantize()


@torch.no_grad()
def search_scales(x: torch.Tensor, weights: list[torch.Tensor], bits: int, group_size: int) -> torch.Tensor:
    """The per-input-channel scales ``[in]`` for linears ``weights`` (each ``[out_i, in]``) reading
    ``x [tokens, in]``."""
    w = torch.cat([t.float() for t in weights])  # [out, in]
    in_f = w.shape[1]
    gs = in_f if group_size == -1 else group_size
    w_norm = (w.abs().view(w.shape[0], in_f // gs, gs) /
              w.abs().view(w.shape[0], in_f // gs, gs).amax(dim=2, keepdim=True).clamp(min=1e-8))
    w_mean = w_norm.view(w.shape[0], in_f).mean(dim=0)  # [in]
    x_mean = x.abs().float().mean(dim=0)  # [in]
    reference = x @ w.t()  # [tokens, out]
    best, best_loss = torch.ones(in_f, device=w.device), float("inf")
    for step in range(GRID):
        a = step / GRID
        s = (x_mean.pow(a) / w_mean.clamp(min=1e-4).pow(1 - a)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        q = fake_quantize(w * s, bits, group_size) / s
        loss = float((x @ q.t() - reference).pow(2).mean())
        if loss < best_loss:
            best, best_loss = s, loss
    return best
