"""``--quantize gptq`` / ``--quantize awq`` on a random-weight model (``random:NAME``): each drawn
dense weight is rounded to nearest (RTN) into the format's packed tensors as soon as its layer's
parts are in, exactly as ``--quantize fp8`` / ``nf4`` do, so a benchmark measures the int4
kernels with no checkpoint on disk. (Random weights make calibration meaningless: GPTQ's and
AWQ's searches would change the values, not the speed.) On CUDA the packed tensors are then
repacked for the kernels like a checkpoint's.

Groups: 128 inputs, or the largest of 64 / 32 that divides every layer's input (the tiny test
shapes), else one group per output channel. GPTQ: symmetric (zero 8), v1 format; AWQ: zero points.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loom.model_loader.random_model import MARKER
from loom.plugin_api.quantization import WeightLoader

from .awq import AWQLinearMethod
from .dequant_linear import QuantizeWhileLoading
from .gptq import GPTQLinearMethod, GPTQSettings
from .int_packing import AWQ_ORDER, pack_cols
from .make.group_quant import rtn
from .w4a16_layout import pack_rows_int32

BITS = 4


def is_random_model(model_dir: Path) -> bool:
    """Whether ``model_dir`` is a ``random:NAME`` directory (config.json carries the marker)."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get(MARKER) is not None


def random_group_size(model_dir: Path) -> int:
    """128 if it divides every linear layer's input size, else 64 or 32, else -1 (per channel)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    inputs = (hidden, int(config["intermediate_size"]), heads * head_dim)
    for group in (128, 64, 32):
        if all(size % group == 0 for size in inputs):
            return group
    return -1


class _RandomIntMixin(QuantizeWhileLoading):
    """The while-loading half shared by GPTQ and AWQ: the dense placeholder (and the activation
    dtype the kernels are prepared for)."""

    def create_weights(self, layer: Any, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        layer.w4a16_dtype = params_dtype
        super().create_weights(layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                               params_dtype, weight_loader)



def _register(layer: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    for name, tensor in tensors.items():
        layer.register_buffer(name, tensor)


class GPTQWhileLoadingMethod(_RandomIntMixin, GPTQLinearMethod):
    """RTN into GPTQ v1 tensors (``qweight [in/8, out]``, ``qzeros`` storing zero - 1, fp16 scales)."""

    def __init__(self, group_size: int) -> None:
        GPTQLinearMethod.__init__(self, GPTQSettings(bits=BITS, group_size=group_size, desc_act=False, sym=True,
                                                     checkpoint_format="gptq"))

    def quantize(self, layer: Any, weight: torch.Tensor) -> None:
        ql = rtn(weight, BITS, self.group_size, sym=True, min_zero=1)  # codes [out, in], scales / zeros [out, G]
        _register(layer, {
            "qweight": pack_rows_int32(ql.codes.t(), BITS),
            "qzeros": pack_cols((ql.zeros.t() - 1) & ((1 << BITS) - 1), BITS),
            "scales": ql.scales.t().contiguous().half(),
        })

    def process_weights_after_loading(self, layer: Any) -> None:
        QuantizeWhileLoading.process_weights_after_loading(self, layer)  # drops the placeholder
        self.repack(layer)


class AWQWhileLoadingMethod(_RandomIntMixin, AWQLinearMethod):
    """RTN with zero points into AWQ GEMM tensors (``qweight [in, out/8]`` in AWQ's slot order)."""

    def __init__(self, group_size: int) -> None:
        AWQLinearMethod.__init__(self, BITS, group_size)

    def quantize(self, layer: Any, weight: torch.Tensor) -> None:
        ql = rtn(weight, BITS, self.group_size, sym=False)
        _register(layer, {
            "qweight": pack_cols(ql.codes.t(), BITS, AWQ_ORDER),
            "qzeros": pack_cols(ql.zeros.t(), BITS, AWQ_ORDER),
            "scales": ql.scales.t().contiguous().half(),
        })

    def process_weights_after_loading(self, layer: Any) -> None:
        QuantizeWhileLoading.process_weights_after_loading(self, layer)  # drops the placeholder
        self.repack(layer)
