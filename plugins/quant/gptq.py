"""The ``gptq`` quantizer: GPTQ checkpoints (AutoGPTQ's v1 "gptq" format and gptqmodel's ``gptq_v2``).

Per quantized linear layer (``W [out, in]``, ``f = 32 / bits`` values a word, ``G`` groups):

- ``qweight`` int32 ``[in / f, out]``: W's codes packed along the *input* dimension (row r of
  the word matrix holds inputs ``r*f ..``, lowest first: :func:`int_packing.unpack_rows`);
- ``qzeros`` int32 ``[G, out / f]``: each group's zero point packed along the output dimension.
  v1 ("gptq") stores ``zero - 1`` (a reader adds 1 back: 4-bit symmetric stores 7s); ``gptq_v2``
  stores the zero itself (reading v2 as v1 shifts every weight by one step: garbage output);
- ``scales`` float16 ``[G, out]``;
- ``g_idx`` int32 ``[in]``: input i's group, ``i // group_size`` unless act-order (``desc_act``)
  quantized the inputs in another order. Without desc_act it is that identity and not read.

Tensor parallelism: a column-parallel rank keeps its output columns of every tensor. A
row-parallel rank keeps its slice of the input rows of ``qweight``; without act-order also its
whole groups of ``scales`` / ``qzeros``; with act-order its slice of ``g_idx`` (global group
numbers) and *every* group's ``scales`` / ``qzeros``, since its inputs belong to groups scattered
over the whole input. Such a slice repacks for the kernels only when it holds whole groups; the
usual case (parts of many groups) keeps the dequantizing path, on the GPU too.

``W[o, i] = scales[g_idx[i], o] * (q[i, o] - zero[g_idx[i], o])``, computed exactly in float32.
Group size -1 is one group over the whole input (per output channel). A group size must divide
every quantized layer's input size (no ragged last group: other readers would refuse it too).
A fused layer (qkv, gate/up) loads its parts' columns side by side; each part keeps its own g_idx.
The head is quantized when the checkpoint holds ``lm_head.qweight`` (GPTQModel's ``lm_head=True``,
which also writes ``quantization_config.lm_head: true``), tied in the config or not.

On a CUDA device with Triton, GPTQ and AWQ layers are repacked at load into the layout of
``w4a16_layout`` (act-order inputs sorted by group once) and served by ``w4a16_triton``'s
kernels; the checkpoint's tensors are dropped. Elsewhere the layer dequantizes per call.

``--quantize gptq`` on a random-weight model (``random:NAME``, for benchmarks) rounds each drawn
weight to nearest while it loads (4-bit, symmetric, groups of 128 or the largest of 64 / 32
that divides every layer's input) into this format: no checkpoint is needed to measure speed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import structlog
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

from . import w4a16_triton
from .checkpoint_layers import bool_field, checkpoint_tensor_names, int_field, quantized_parts
from .dequant_linear import DequantLinearMethod, Kernel, WarmUp, part_index, rows_per_part
from .int_packing import SUPPORTED_BITS, per_word, unpack_cols, unpack_rows
from .w4a16_layout import NotRepackable, W4A16Layout, from_int_codes

log = structlog.get_logger(__name__)

FORMATS = ("gptq", "gptq_v2")
HEAD = "lm_head"  # the logits head's checkpoint module: quantized when the checkpoint holds its qweight


@dataclass(frozen=True)
class GPTQSettings:
    bits: int
    group_size: int  # -1: one group per output channel
    desc_act: bool
    sym: bool
    checkpoint_format: str  # "gptq" (zeros stored minus one) or "gptq_v2"
    lm_head: bool = False  # the config says the head is quantized too (GPTQModel's lm_head=True)

    @classmethod
    def parse(cls, qconfig: dict[str, Any]) -> GPTQSettings:
        bits = int_field(qconfig, ("bits",), None, f"one of {SUPPORTED_BITS}", "GPTQ")
        if bits not in SUPPORTED_BITS:
            raise QuantizationError(f"GPTQ quantization_config.bits is {bits}; supported: "
                                    f"{', '.join(map(str, SUPPORTED_BITS))} (widths that fill int32 words)")
        group = int_field(qconfig, ("group_size",), 128, "a positive number of inputs, or -1", "GPTQ")
        if group == 0 or group < -1:
            raise QuantizationError(f"GPTQ quantization_config.group_size is {group}; expected a positive number "
                                    "of inputs per group, or -1 for one group per output channel")
        fmt = qconfig.get("checkpoint_format", qconfig.get("format", "gptq"))
        if fmt not in FORMATS:
            raise QuantizationError(f"GPTQ quantization_config.checkpoint_format is {fmt!r}; supported: "
                                    f"{', '.join(FORMATS)} (repack others, e.g. marlin, with their tools)")
        return cls(bits=bits, group_size=group, desc_act=bool_field(qconfig, "desc_act", False, "GPTQ"),
                   sym=bool_field(qconfig, "sym", True, "GPTQ"), checkpoint_format=str(fmt),
                   lm_head=bool_field(qconfig, "lm_head", False, "GPTQ"))

    def groups(self, input_size: int, prefix: str) -> int:
        if self.group_size == -1:
            return 1
        if input_size % self.group_size:
            raise QuantizationError(
                f"{prefix}: its input size {input_size} is not a multiple of quantization_config.group_size "
                f"{self.group_size} (groups must tile the input; e.g. 576 = 9 x 64 takes group size 64 or 32)")
        return input_size // self.group_size


class PackedIntMethod(DequantLinearMethod):
    """Integer codes with per-group scales and zero points; the layout is the format's until a
    CUDA load repacks it for the kernels (:meth:`repack`)."""

    fmt = ""
    kernels: ClassVar[dict[str, list[Kernel]]] = {"cuda": [w4a16_triton.layer_kernel]}
    warm_ups: ClassVar[tuple[WarmUp, ...]] = (w4a16_triton.layer_warm_up_token_counts,)
    checkpoint_tensors: ClassVar[tuple[str, ...]] = ("qweight", "qzeros", "scales")

    def __init__(self, bits: int, group_size: int) -> None:
        self.bits, self.group_size, self.f = bits, group_size, per_word(bits)

    def _groups(self, layer: Any, input_size: int) -> int:
        if self.group_size == -1:
            return 1
        if input_size % self.group_size:
            raise QuantizationError(f"{getattr(layer, 'prefix', '')}: its input size {input_size} is not a multiple "
                                    f"of quantization_config.group_size {self.group_size}")
        return input_size // self.group_size

    def _check_in(self, layer: Any, input_size: int) -> None:
        if input_size % self.f:
            raise QuantizationError(f"{self.fmt} {getattr(layer, 'prefix', '')}: input size {input_size} does not "
                                    f"fill whole int32 words of {self.f} {self.bits}-bit values")

    def _check_out(self, layer: Any, output_partition_sizes: list[int]) -> None:
        for rows in output_partition_sizes:
            if rows % self.f:
                raise QuantizationError(f"{self.fmt} {getattr(layer, 'prefix', '')}: output size {rows} does not fill "
                                        f"whole int32 words of {self.f} {self.bits}-bit zeros")

    def group_index(self, layer: Any, part: int, input_size: int) -> torch.Tensor:
        """``[in]`` long: each input's group for part ``part``."""
        device = layer.scales.device
        if self.group_size == -1:
            return torch.zeros(input_size, dtype=torch.long, device=device)
        return torch.arange(input_size, device=device) // self.group_size

    def codes_and_zeros(self, layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q [in, out], zeros [G, out])`` int32, in the checkpoint's output order."""
        raise NotImplementedError

    @staticmethod
    def register_g_idx(layer: Any, input_size_per_partition: int, input_size: int, parts: int, what: str) -> None:
        """Act-order's ``g_idx [parts, in (this rank's)]``: each fused part's own input order, loaded
        from the checkpoint's ``[in]`` (``what`` names that tensor in errors). A row-parallel rank
        keeps its slice (inputs ``rank * in_per_rank ..``; every other layer keeps all of them), its
        values global group numbers."""
        prefix = str(getattr(layer, "prefix", ""))
        g_idx = nn.Parameter(torch.empty(parts, input_size_per_partition, dtype=torch.int32), requires_grad=False)
        first = int(getattr(layer, "tp_rank", 0)) * input_size_per_partition \
            if input_size_per_partition != input_size else 0

        def load_g_idx(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
            if tuple(loaded.shape) != (input_size,):
                raise QuantizationError(f"{what}: checkpoint shape {tuple(loaded.shape)}, expected ({input_size},)")
            loaded = loaded[first:first + input_size_per_partition]  # [in (this rank's)]
            if shard_id is None:
                param.data.copy_(loaded.expand(parts, -1))
            else:
                param.data[part_index(shard_id, parts, prefix)].copy_(loaded)

        set_weight_attrs(g_idx, weight_loader=load_g_idx)
        layer.register_parameter("g_idx", g_idx)

    @staticmethod
    def check_g_idx(layer: Any, what: str) -> None:
        """Every ``g_idx`` value names one of the layer's groups (``what`` names the tensor)."""
        groups = layer.scales.shape[0]
        bad = (layer.g_idx < 0) | (layer.g_idx >= groups)
        if bool(bad.any()):
            raise QuantizationError(f"{what}: values must be group indices in [0, {groups}), found "
                                    f"{int(layer.g_idx[bad][0])}")

    def to_layout(self, layer: Any) -> W4A16Layout:
        """The layer's codes in the kernels' layout (NotRepackable: it keeps the checkpoint's)."""
        q, zeros = self.codes_and_zeros(layer)
        return from_int_codes(q, zeros, layer.scales, self.bits, self.group_size, rows_per_part(layer), None,
                              activation_dtype(layer))

    def repack(self, layer: Any) -> None:
        """On CUDA with Triton: the kernel layout replaces the checkpoint's tensors."""
        if not w4a16_triton.repacks_on(layer.scales.device):
            return
        try:
            layout = self.to_layout(layer)
        except NotRepackable as exc:
            log.info("layer keeps the dequantizing path", layer=getattr(layer, "prefix", ""), reason=str(exc))
            return
        for name in (*self.checkpoint_tensors, "g_idx"):
            layer._parameters.pop(name, None)
            layer._buffers.pop(name, None)
        layout.register(layer)

    def process_weights_after_loading(self, layer: Any) -> None:
        self.repack(layer)

    def dequantize(self, layer: Any, dtype: torch.dtype) -> torch.Tensor:
        layout = layer.__dict__.get("w4a16")
        if layout is not None:
            return layout.dequantize(dtype)
        q, zeros = self.codes_and_zeros(layer)  # [in, out], [G, out]
        scales = layer.scales.float()  # [G, out]
        input_size = q.shape[0]
        wt = torch.empty(q.shape, dtype=torch.float32, device=q.device)  # W^T [in, out]
        start = 0
        for part, rows in enumerate(rows_per_part(layer)):
            cols = slice(start, start + rows)
            g = self.group_index(layer, part, input_size)  # [in]
            # exact: |q - z| < 2^bits times an fp16 scale fits float32's 24-bit mantissa
            wt[:, cols] = (q[:, cols] - zeros[g, cols]).float() * scales[g, cols]
            start += rows
        return wt.t().to(dtype)


class GPTQLinearMethod(PackedIntMethod):
    fmt = "GPTQ"

    def __init__(self, settings: GPTQSettings) -> None:
        super().__init__(settings.bits, settings.group_size)
        self.settings = settings

    def create_weights(self, layer: Any, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        prefix = str(getattr(layer, "prefix", ""))
        layer.w4a16_dtype = params_dtype
        self._check_in(layer, input_size_per_partition)
        self._check_out(layer, output_partition_sizes)
        out = sum(output_partition_sizes)
        # Without act-order groups follow the input: a row-parallel rank keeps its whole groups
        # (even a single one). With act-order a group's inputs are scattered over the whole input,
        # so a rank's slice of inputs (and of g_idx, whose values stay global group numbers) needs
        # every group's scales and zeros: G = input_size / group_size on every rank. group_size -1
        # is one group over every input, the same on every rank.
        groups = self._groups(layer, input_size if self.settings.desc_act else input_size_per_partition)
        row_split = 0 if self.group_size != -1 and not self.settings.desc_act else None
        qweight = nn.Parameter(torch.empty(input_size_per_partition // self.f, out, dtype=torch.int32),
                               requires_grad=False)
        set_weight_attrs(qweight, input_dim=0, output_dim=1, packed_dim=0, packed_factor=self.f,
                         weight_loader=weight_loader)
        qzeros = nn.Parameter(torch.empty(groups, out // self.f, dtype=torch.int32), requires_grad=False)
        set_weight_attrs(qzeros, input_dim=row_split, output_dim=1, packed_dim=1, packed_factor=self.f,
                         weight_loader=weight_loader)
        scales = nn.Parameter(torch.empty(groups, out, dtype=torch.float16), requires_grad=False)
        set_weight_attrs(scales, input_dim=row_split, output_dim=1, weight_loader=weight_loader)
        layer.register_parameter("qweight", qweight)
        layer.register_parameter("qzeros", qzeros)
        layer.register_parameter("scales", scales)
        if self.settings.desc_act:
            self.register_g_idx(layer, input_size_per_partition, input_size, len(output_partition_sizes),
                                f"GPTQ {prefix}.g_idx")

    def process_weights_after_loading(self, layer: Any) -> None:
        if self.settings.desc_act:
            self.check_g_idx(layer, f"GPTQ {getattr(layer, 'prefix', '')}.g_idx")
        self.repack(layer)

    def to_layout(self, layer: Any) -> W4A16Layout:
        zeros = unpack_cols(layer.qzeros, self.bits)
        if self.settings.checkpoint_format == "gptq":
            zeros = zeros + 1  # v1 stores zero - 1
        g_idx = layer.g_idx if self.settings.desc_act else None
        codes = unpack_rows(layer.qweight, self.bits) if g_idx is not None else None
        # Without act-order the checkpoint's qweight is already the kernels' layout: kept as it is.
        return from_int_codes(codes, zeros, layer.scales, self.bits, self.group_size, rows_per_part(layer), g_idx,
                              activation_dtype(layer), packed=layer.qweight.data)

    def group_index(self, layer: Any, part: int, input_size: int) -> torch.Tensor:
        if self.settings.desc_act:
            return layer.g_idx[part].long()
        return super().group_index(layer, part, input_size)

    def codes_and_zeros(self, layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
        q = unpack_rows(layer.qweight, self.bits)  # [in, out]
        zeros = unpack_cols(layer.qzeros, self.bits)  # [G, out]
        if self.settings.checkpoint_format == "gptq":
            zeros = zeros + 1  # v1 stores zero - 1
        return q, zeros


def activation_dtype(layer: Any) -> torch.dtype:
    """The dtype the layer's activations come in (the model's), recorded when its weights were made."""
    return getattr(layer, "w4a16_dtype", None) or torch.get_default_dtype()


class GPTQConfig(QuantizationConfig):
    """A GPTQ checkpoint: every linear layer whose ``qweight`` the checkpoint holds is served by
    :class:`GPTQLinearMethod`; the others (an unquantized head...) stay dense."""

    quant_methods = ("gptq",)
    quantizes_random_weights = True  # random:NAME: round to nearest while loading (int_while_loading)

    @classmethod
    def check_checkpoint_config(cls, quantization_config: dict[str, Any]) -> None:
        GPTQSettings.parse(quantization_config)

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> None:
        from .int_while_loading import is_random_model, random_group_size

        super().__init__(model_dir, device, dtype)
        self.random = is_random_model(model_dir)
        if self.random:
            self.quant = GPTQSettings(bits=4, group_size=random_group_size(model_dir), desc_act=False, sym=True,
                                      checkpoint_format="gptq")
            self.names: set[str] = set()
            return
        qconfig = checkpoint_quantization_config(model_dir)
        if qconfig is None or str(qconfig.get("quant_method", "")).lower() != "gptq":
            raise QuantizationError(f"{model_dir}/config.json has no GPTQ quantization_config")
        self.quant = GPTQSettings.parse(qconfig)
        self.names = checkpoint_tensor_names(model_dir)
        if self.quant.lm_head and f"{HEAD}.qweight" not in self.names:
            raise QuantizationError(f"GPTQ quantization_config.lm_head is true but the checkpoint has no {HEAD}.qweight "
                                    f"(a quantized head needs {HEAD}.qweight, .qzeros and .scales)")

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        if self.random:
            from loom.layers.linear import LinearBase

            from .int_while_loading import GPTQWhileLoadingMethod

            return GPTQWhileLoadingMethod(self.quant.group_size) if isinstance(layer, LinearBase) else None
        required = ("qzeros", "scales", "g_idx") if self.quant.desc_act else ("qzeros", "scales")
        if quantized_parts(self, self.names, prefix, "qweight", required, "GPTQ") is None:
            return None
        self.quant.groups(int(getattr(layer, "input_size")), prefix)  # noqa: B009 - every linear layer has it
        return GPTQLinearMethod(self.quant)

    def skips_checkpoint_tensor(self, name: str) -> bool:
        # Without act-order g_idx is i // group_size: nothing to read.
        return not self.quant.desc_act and name.endswith(".g_idx")

    def keeps_checkpoint_dtype(self, name: str) -> bool:
        return name.endswith(".scales")  # float16 in the format: the model's dtype may not hold them

    def settings(self) -> dict[str, str]:
        q = self.quant
        return {"format": "rtn while loading" if self.random else q.checkpoint_format, "bits": str(q.bits), "group_size": str(q.group_size),
                "sym": str(q.sym).lower(), "desc_act": str(q.desc_act).lower(),
                "lm_head": str(f"{HEAD}.qweight" in self.names).lower()}
