"""The ``wna16`` quantizer: compressed-tensors ``pack-quantized`` integer weights (W4A16 / W8A16),
the format LLM Compressor (vLLM's own quantization library) writes for GPTQ, AWQ and RTN models.

config.json's ``quantization_config`` has ``quant_method: compressed-tensors``, ``format:
pack-quantized`` and one config group whose ``weights`` are ``type: int``, ``num_bits`` 4 or 8,
``strategy`` ``group`` (``group_size``) or ``channel``, symmetric or not, ``actorder`` null,
``weight`` or ``group``; no ``input_activations`` (the activations stay 16-bit). Per quantized
linear layer (``W [out, in]``, ``f = 32 / bits`` values a word, ``G`` groups):

- ``weight_packed`` int32 ``[out, in / f]``: W's codes packed along the *input*, lowest first,
  each stored as ``q + 2^(bits-1)`` (the signed code made unsigned);
- ``weight_scale`` ``[out, G]`` in the checkpoint's float dtype (bf16 or fp16);
- ``weight_zero_point`` int32 ``[out / f, G]`` (asymmetric only): the signed zero points packed
  along the *output*, offset the same way;
- ``weight_g_idx`` int32 ``[in]`` (``actorder: group`` only): input i's group;
- ``weight_shape`` ``[2]``: W's shape (not read: the layer knows it and the loaders check the
  packed shapes).

``W[o, i] = weight_scale[o, g(i)] * (q[o, i] - zp[o, g(i)])`` with ``q`` and ``zp`` the signed
values (the offsets cancel), computed exactly in float32; symmetric checkpoints have ``zp = 0``.
In GPTQ's terms the unsigned code is the code and ``2^(bits-1)`` (or the unsigned zero point) is
the zero, so the layer reuses :class:`~loom_plugins.quant.gptq.PackedIntMethod`: dequantized per
call on the CPU, repacked at load on CUDA into ``w4a16_layout`` for the same Triton kernels as
GPTQ and AWQ (act-order inputs sorted by group once). Tensor parallelism follows GPTQ's rules,
act-order included.

Layers the checkpoint keeps dense (``ignore``, usually ``lm_head``) have a ``weight`` instead and
stay dense. Other compressed-tensors formats are refused in one sentence naming the field: FP8
(``float-quantized``) is the ``fp8`` quantizer's; integer activations (W8A8, W4A8), 2:4 sparsity
and transforms are not served.
"""

from __future__ import annotations

from dataclasses import dataclass
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

from .checkpoint_layers import checkpoint_tensor_names, quantized_parts
from .dequant_linear import rows_per_part
from .gptq import PackedIntMethod, activation_dtype
from .int_packing import unpack_cols, unpack_rows
from .w4a16_layout import W4A16Layout, from_int_codes

FORMAT = "pack-quantized"
BITS = (4, 8)
# "weight": quantized in activation order with the groups kept contiguous (nothing to read);
# "group" (written by compressed-tensors before 0.20): a g_idx names each input's group
ACTORDERS = (None, "weight", "group")
WHERE = "compressed-tensors quantization_config"


@dataclass(frozen=True)
class WNA16Settings:
    bits: int
    group_size: int  # -1: one group per output channel (strategy "channel")
    sym: bool
    actorder: str | None  # "group": a g_idx per layer

    @classmethod
    def parse(cls, qconfig: dict[str, Any]) -> WNA16Settings:
        """The settings of a pack-quantized config, or QuantizationError naming the field."""
        fmt = qconfig.get("format")
        if fmt != FORMAT:
            raise QuantizationError(f"{WHERE}.format is {fmt!r}; the wna16 quantizer reads {FORMAT} integer "
                                    "weights (float-quantized FP8 is the fp8 quantizer's)")
        for field, what in (("sparsity_config", "2:4 sparse"), ("transform_config", "transformed (rotated)")):
            if qconfig.get(field):
                raise QuantizationError(f"{WHERE}.{field} is set: {what} compressed-tensors checkpoints are not "
                                        "supported")
        groups = qconfig.get("config_groups")
        if not isinstance(groups, dict) or len(groups) != 1:
            raise QuantizationError(f"{WHERE}.config_groups must hold exactly one group (one scheme for every "
                                    f"layer), got {len(groups) if isinstance(groups, dict) else groups!r}")
        name, group = next(iter(groups.items()))
        where = f"{WHERE}.config_groups.{name}"
        if not isinstance(group, dict):
            raise QuantizationError(f"{where} must be an object, got {group!r}")
        if group.get("input_activations") is not None:
            acts = group["input_activations"] if isinstance(group["input_activations"], dict) else {}
            raise QuantizationError(f"{where}.input_activations is {acts.get('num_bits')}-bit "
                                    f"{acts.get('type')!r}: quantized activations (W8A8, W4A8) are not supported; "
                                    "weight-only schemes (W4A16, W8A16) are")
        weights = group.get("weights")
        if not isinstance(weights, dict):
            raise QuantizationError(f"{where}.weights is missing: nothing to dequantize")
        if weights.get("type") != "int":
            raise QuantizationError(f"{where}.weights.type is {weights.get('type')!r}; expected int")
        bits = weights.get("num_bits")
        if bits not in BITS:
            raise QuantizationError(f"{where}.weights.num_bits is {bits!r}; supported: 4, 8")
        if weights.get("dynamic"):
            raise QuantizationError(f"{where}.weights.dynamic is true; weight scales must be stored")
        strategy = weights.get("strategy")
        if strategy == "group":
            size = weights.get("group_size")
            if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
                raise QuantizationError(f"{where}.weights.group_size is {size!r}; expected a positive number of "
                                        "inputs per group")
        elif strategy == "channel":
            size = -1
        else:
            raise QuantizationError(f"{where}.weights.strategy is {strategy!r}; supported: group, channel")
        sym = weights.get("symmetric", True)
        if not isinstance(sym, bool):
            raise QuantizationError(f"{where}.weights.symmetric must be true or false, got {sym!r}")
        actorder = weights.get("actorder")
        # (older compressed-tensors also wrote static for weight and dynamic for group; true is group)
        if isinstance(actorder, (bool, str)):
            actorder = {False: None, True: "group", "static": "weight", "dynamic": "group"}.get(actorder, actorder)
        if actorder not in ACTORDERS:
            raise QuantizationError(f"{where}.weights.actorder is {actorder!r}; supported: null, weight, group")
        if actorder == "group" and strategy != "group":
            raise QuantizationError(f"{where}.weights.actorder is group but the strategy is {strategy!r}")
        return cls(bits=int(bits), group_size=size, sym=sym, actorder=actorder)


class WNA16LinearMethod(PackedIntMethod):
    fmt = "compressed-tensors"
    checkpoint_tensors = ("weight_packed", "weight_zero_point", "weight_scale", "scales")

    def __init__(self, settings: WNA16Settings) -> None:
        super().__init__(settings.bits, settings.group_size)
        self.settings = settings

    @property
    def g_idx(self) -> bool:
        return self.settings.actorder == "group"

    def create_weights(self, layer: Any, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        prefix = str(getattr(layer, "prefix", ""))
        layer.w4a16_dtype = params_dtype
        self._check_in(layer, input_size_per_partition)
        out = sum(output_partition_sizes)
        # as GPTQ: a row-parallel rank keeps its whole groups, except with a g_idx, whose groups
        # are scattered over the whole input (every rank keeps every group's scales and zeros)
        groups = self._groups(layer, input_size if self.g_idx else input_size_per_partition)
        row_split = 1 if self.group_size != -1 and not self.g_idx else None
        packed = nn.Parameter(torch.empty(out, input_size_per_partition // self.f, dtype=torch.int32),
                              requires_grad=False)
        set_weight_attrs(packed, input_dim=1, output_dim=0, packed_dim=1, packed_factor=self.f,
                         weight_loader=weight_loader)
        layer.register_parameter("weight_packed", packed)
        # float32 holds the checkpoint's bf16 or fp16 scales exactly (kept in their dtype to load)
        scale = nn.Parameter(torch.empty(out, groups, dtype=torch.float32), requires_grad=False)
        set_weight_attrs(scale, input_dim=row_split, output_dim=0, weight_loader=weight_loader)
        layer.register_parameter("weight_scale", scale)
        if not self.settings.sym:
            self._check_out(layer, output_partition_sizes)
            zero = nn.Parameter(torch.empty(out // self.f, groups, dtype=torch.int32), requires_grad=False)
            set_weight_attrs(zero, input_dim=row_split, output_dim=0, packed_dim=0, packed_factor=self.f,
                             weight_loader=weight_loader)
            layer.register_parameter("weight_zero_point", zero)
        if self.g_idx:
            self.register_g_idx(layer, input_size_per_partition, input_size, len(output_partition_sizes),
                                f"compressed-tensors {prefix}.weight_g_idx")

    def process_weights_after_loading(self, layer: Any) -> None:
        # GPTQ's orientation for the shared code: scales [G, out]
        layer.register_buffer("scales", layer.weight_scale.data.t().contiguous(), persistent=False)
        del layer.weight_scale
        if self.g_idx:
            self.check_g_idx(layer, f"compressed-tensors {getattr(layer, 'prefix', '')}.weight_g_idx")
        self.repack(layer)

    def codes_and_zeros(self, layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
        q = unpack_cols(layer.weight_packed, self.bits).t()  # [in, out], unsigned (q + 2^(bits-1))
        if self.settings.sym:
            zeros = torch.full((layer.scales.shape[0], q.shape[1]), 1 << (self.bits - 1), dtype=torch.int32,
                               device=q.device)
        else:
            zeros = unpack_rows(layer.weight_zero_point, self.bits).t()  # [G, out], offset alike
        return q, zeros

    def group_index(self, layer: Any, part: int, input_size: int) -> torch.Tensor:
        if self.g_idx:
            return layer.g_idx[part].long()
        return super().group_index(layer, part, input_size)

    def to_layout(self, layer: Any) -> W4A16Layout:
        q, zeros = self.codes_and_zeros(layer)
        g_idx = layer.g_idx if self.g_idx else None
        return from_int_codes(q.contiguous(), zeros, layer.scales, self.bits, self.group_size, rows_per_part(layer),
                              g_idx, activation_dtype(layer))


class WNA16Config(QuantizationConfig):
    """A compressed-tensors pack-quantized checkpoint: layers whose ``weight_packed`` it holds get
    :class:`WNA16LinearMethod`; the others (``ignore``) stay dense."""

    quant_methods = ("compressed-tensors",)

    @classmethod
    def serves_checkpoint_config(cls, quantization_config: dict[str, Any]) -> bool:
        return quantization_config.get("format") == FORMAT

    @classmethod
    def check_checkpoint_config(cls, quantization_config: dict[str, Any]) -> None:
        WNA16Settings.parse(quantization_config)

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(model_dir, device, dtype)
        qconfig = checkpoint_quantization_config(model_dir)
        if qconfig is None or not self.serves_checkpoint_config(qconfig):
            raise QuantizationError(f"{model_dir}/config.json has no compressed-tensors {FORMAT} quantization_config")
        self.quant = WNA16Settings.parse(qconfig)
        self.names = checkpoint_tensor_names(model_dir)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        q = self.quant
        required = ("weight_scale",) + (() if q.sym else ("weight_zero_point",)) + \
            (("weight_g_idx",) if q.actorder == "group" else ())
        if quantized_parts(self, self.names, prefix, "weight_packed", required, "compressed-tensors") is None:
            return None
        input_size = int(getattr(layer, "input_size"))  # noqa: B009 - every linear layer has it
        if q.group_size != -1 and input_size % q.group_size:
            raise QuantizationError(f"{prefix}: its input size {input_size} is not a multiple of the "
                                    f"weights' group_size {q.group_size}")
        return WNA16LinearMethod(q)

    def rename_checkpoint_tensor(self, name: str) -> str:
        return name.removesuffix(".weight_g_idx") + ".g_idx" if name.endswith(".weight_g_idx") else name

    def skips_checkpoint_tensor(self, name: str) -> bool:
        return name.endswith(".weight_shape") or (self.quant.actorder != "group" and name.endswith(".weight_g_idx"))

    def keeps_checkpoint_dtype(self, name: str) -> bool:
        return name.endswith(".weight_scale")  # loaded into float32: exact from the checkpoint's bf16 / fp16

    def settings(self) -> dict[str, str]:
        q = self.quant
        return {"format": FORMAT, "bits": str(q.bits), "group_size": str(q.group_size), "sym": str(q.sym).lower(),
                "actorder": str(q.actorder).lower()}
