"""The ``awq`` quantizer: AWQ "GEMM" checkpoints (AutoAWQ's format, as vLLM and transformers read it).

Per quantized linear layer (``W [out, in]``, 4-bit, ``G = in / group_size`` groups):

- ``qweight`` int32 ``[in, out / 8]``: W^T's codes packed along the *output* dimension, a word's
  8 slots holding columns ``0, 2, 4, 6, 1, 3, 5, 7`` of its group of 8 (``int_packing.AWQ_ORDER``);
- ``qzeros`` int32 ``[G, out / 8]``: zero points, the same packing, stored as they are (no -1);
- ``scales`` float16 ``[G, out]``.

``W[o, i] = scales[i // group_size, o] * (q[i, o] - zeros[i // group_size, o])``, exactly in float32.
No g_idx (AWQ has no act-order). Only ``version: gemm`` is read: GEMV and the Marlin / exllama
repacks lay the words out differently. On CUDA the layer is repacked at load into the layout
GPTQ's kernels read (``w4a16_layout``: codes packed along the input instead of the output).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from loom.plugin_api.quantization import (
    LinearMethod,
    QuantizationConfig,
    QuantizationError,
    WeightLoader,
    checkpoint_quantization_config,
    set_weight_attrs,
)

from .checkpoint_layers import bool_field, checkpoint_tensor_names, int_field, quantized_parts
from .gptq import PackedIntMethod
from .int_packing import AWQ_ORDER, unpack_cols

VERSIONS = ("gemm",)


def parse_awq(qconfig: dict[str, Any]) -> tuple[int, int]:
    """``(bits, group_size)`` of an AWQ quantization_config, or QuantizationError naming the field."""
    bits = int_field(qconfig, ("bits", "w_bit"), 4, "4", "AWQ")
    if bits != 4:
        raise QuantizationError(f"AWQ quantization_config.bits is {bits}; AWQ GEMM checkpoints are 4-bit")
    group = int_field(qconfig, ("group_size", "q_group_size"), 128, "a positive number of inputs", "AWQ")
    if group <= 0:
        raise QuantizationError(f"AWQ quantization_config.group_size is {group}; expected a positive number of "
                                "inputs per group (64, 128...)")
    if not bool_field(qconfig, "zero_point", True, "AWQ"):
        raise QuantizationError("AWQ quantization_config.zero_point is false; only AWQ with zero points "
                                "(zero_point: true) is supported")
    version = str(qconfig.get("version", "gemm")).lower()
    if version not in VERSIONS:
        raise QuantizationError(f"AWQ quantization_config.version is {qconfig.get('version')!r}; supported: gemm "
                                "(GEMV, Marlin and exllama checkpoints pack their words differently)")
    return bits, group


class AWQLinearMethod(PackedIntMethod):
    fmt = "AWQ"

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        self._check_out(layer, output_partition_sizes)
        layer.__dict__["w4a16_dtype"] = params_dtype  # the kernels are prepared for it
        out = sum(output_partition_sizes)
        groups = self._groups(layer, input_size_per_partition)
        qweight = nn.Parameter(torch.empty(input_size_per_partition, out // self.f, dtype=torch.int32),
                               requires_grad=False)
        set_weight_attrs(qweight, input_dim=0, output_dim=1, packed_dim=1, packed_factor=self.f,
                         weight_loader=weight_loader)
        qzeros = nn.Parameter(torch.empty(groups, out // self.f, dtype=torch.int32), requires_grad=False)
        set_weight_attrs(qzeros, input_dim=0, output_dim=1, packed_dim=1, packed_factor=self.f,
                         weight_loader=weight_loader)
        scales = nn.Parameter(torch.empty(groups, out, dtype=torch.float16), requires_grad=False)
        set_weight_attrs(scales, input_dim=0, output_dim=1, weight_loader=weight_loader)
        layer.register_parameter("qweight", qweight)
        layer.register_parameter("qzeros", qzeros)
        layer.register_parameter("scales", scales)

    def codes_and_zeros(self, layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return unpack_cols(layer.qweight, self.bits, AWQ_ORDER), unpack_cols(layer.qzeros, self.bits, AWQ_ORDER)


class AWQConfig(QuantizationConfig):
    """An AWQ GEMM checkpoint: layers whose ``qweight`` it holds get :class:`AWQLinearMethod`."""

    quant_methods = ("awq",)
    quantizes_random_weights = True  # random:NAME: round to nearest while loading (int_while_loading)

    @classmethod
    def check_checkpoint_config(cls, quantization_config: dict[str, Any]) -> None:
        parse_awq(quantization_config)

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> None:
        from .int_while_loading import is_random_model, random_group_size

        super().__init__(model_dir, device, dtype)
        self.random = is_random_model(model_dir)
        if self.random:
            self.bits, self.group_size, self.names = 4, random_group_size(model_dir), set()
            return
        qconfig = checkpoint_quantization_config(model_dir)
        if qconfig is None or str(qconfig.get("quant_method", "")).lower() != "awq":
            raise QuantizationError(f"{model_dir}/config.json has no AWQ quantization_config")
        self.bits, self.group_size = parse_awq(qconfig)
        self.names = checkpoint_tensor_names(model_dir)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        if self.random:
            from loom.layers.linear import LinearBase

            from .int_while_loading import AWQWhileLoadingMethod

            return AWQWhileLoadingMethod(self.group_size) if isinstance(layer, LinearBase) else None
        if quantized_parts(self, self.names, prefix, "qweight", ("qzeros", "scales"), "AWQ") is None:
            return None
        input_size = int(getattr(layer, "input_size"))  # noqa: B009 - every linear layer has it
        if input_size % self.group_size:
            raise QuantizationError(f"{prefix}: its input size {input_size} is not a multiple of "
                                    f"quantization_config.group_size {self.group_size}")
        return AWQLinearMethod(self.bits, self.group_size)

    def keeps_checkpoint_dtype(self, name: str) -> bool:
        return name.endswith(".scales")  # float16 in the format: the model's dtype may not hold them

    def settings(self) -> dict[str, str]:
        return {"format": "rtn while loading" if self.random else "gemm", "bits": str(self.bits), "group_size": str(self.group_size), "zero_point": "true"}
