"""Activations quantized by the kernel that makes them, for the linear layer that takes them next.

An FP8 layer (W8A8) first quantizes its input, each token's row to e4m3 with its own scale: one
more pass over the activations (read twice, codes written), and one more launch, for each of a
Llama layer's four projections. Three of those inputs are made by one kernel each that holds the
row anyway: the RMSNorm before qkv and before gate/up, the SiLU-and-mul before down. Such a
producer, told at build time which layer it feeds (:func:`feed`), asks that layer on every forward
how it would quantize the rows it is about to make (:func:`wanted`: the layer's method says, by
row count, so a CUDA graph captures the same choice every replay); if it would, the producer
quantizes them itself (one fused kernel on CUDA) and hands on :class:`QuantizedRows`, which the
layer multiplies as they are. The codes and scales are those the layer would have made, bit for
bit, so the outputs do not change; only the work does.

``LOOM_FUSED_INPUT_QUANT=0`` (:data:`loom.kernel_switches.fused_input_quant`) keeps every layer
quantizing its own input. The model says which module feeds which (``plugins/models/llama.py``);
nothing else in it changes, and layers with LoRA adapters always take dense input (their delta
multiplies it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from loom import kernel_switches
from loom.plugin_api.quantization import QuantizedRows, RowQuantization

if TYPE_CHECKING:
    from loom.layers.linear import LinearBase

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
TINY_SCALE = 1e-12  # floor of a scale, so an all-zero row does not divide by zero


def feed(producer: nn.Module, consumer: LinearBase) -> None:
    """Tell ``producer`` that its whole output is ``consumer``'s input. Kept outside the module
    registry (the consumer is registered where it lives; this is not a second parent)."""
    producer.__dict__["_feeds"] = consumer


def wanted(producer: nn.Module, rows: int, dtype: torch.dtype) -> RowQuantization | None:
    """How the layer ``producer`` feeds would quantize ``rows`` rows in ``dtype`` first, if it would
    and the switch is on; None: hand it dense rows."""
    consumer: LinearBase | None = producer.__dict__.get("_feeds")
    if consumer is None or not kernel_switches.fused_input_quant:
        return None
    return consumer.input_quantization(rows, dtype)


def row_scales(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``max |x| / 448`` along ``dim`` (kept), at least :data:`TINY_SCALE`, in float32: divided
    tensor by tensor, so correctly rounded on every device as the Triton kernels' ``div_rn`` (CUDA
    divides by a Python scalar as a multiply by its reciprocal, a bit off in some rows)."""
    amax = x.float().abs().amax(dim=dim, keepdim=True)
    return (amax / torch.full_like(amax, FP8_MAX)).clamp(min=TINY_SCALE)


def expand_block_scales(scale: torch.Tensor, block: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    """Block-wise FP8's scales, one per block ``[cdiv(rows, bn), cdiv(cols, bk)]``, as one per
    weight ``[rows, cols]`` in float32 (a partial last block keeps its scale)."""
    return scale.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` rounded to e4m3 (saturating at +-448); ``scale`` broadcasts against ``x``."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def quantize(x: torch.Tensor, how: RowQuantization) -> QuantizedRows:
    """``x [..., K]`` quantized as ``how`` says, in torch (what the fused kernels compute)."""
    rows = x.reshape(-1, x.shape[-1])
    if how.static_scale is not None:
        scales = how.static_scale.float().reshape(1, 1).expand(rows.shape[0], 1).contiguous()
    else:
        scales = row_scales(rows)
    return QuantizedRows(to_e4m3(rows, scales).contiguous(), scales, x.dtype)
