"""The ``fp8`` quantizer: FP8 (e4m3) checkpoints in vLLM's ``fp8`` and compressed-tensors' layouts,
and ``--quantize fp8``, which quantizes a bf16 / fp16 / fp32 checkpoint while it loads.

Per quantized linear layer:

- ``weight`` float8_e4m3fn ``[out, in]``;
- ``weight_scale`` float32: one per tensor (a fused qkv / gate-up layer keeps one per part: the
  checkpoint's separate q, k, v scales) or one per output channel (``[out, 1]``);
- ``input_scale`` float32, one per tensor, when the activations are quantized *statically*;
  dynamic activations are quantized per token (each row's max / 448) at every call, and
  weight-only checkpoints (no ``input_activations``) leave them alone.

``W[o, i] = float(weight[o, i]) * scale[o]``. The activations go through the same e4m3 rounding
a W8A8 kernel applies (``transform_input``), so the CPU path computes what the GPU would, up to
summation order. ``--quantize fp8``: per-output-channel scales (max |w| / 448) and dynamic
per-token activations (no calibration); the head and the embedding stay in the model's dtype.

Mixture-of-Experts layers: their experts are FP8 too (``fp8_moe``: the checkpoint's, or quantized
while loading), computed weight-only; the router stays dense.

Block-wise FP8 (DeepSeek's and Qwen3's releases: ``weight_block_size`` and ``weight_scale_inv``, one
scale per block of 128 x 128 weights; LLM Compressor's ``FP8_BLOCK``): :class:`FP8BlockLinearMethod`
and block-scaled experts, computed weight-only (the checkpoints' dynamic per-group activation
quantization is not emulated); on CUDA its linear layers run the FP8 GEMV at 1-4 rows (each K
tile scaled by its blocks) and dequantize per call past that, its experts run the fused expert
kernels. FP8 KV caches in checkpoints are not read.

On CUDA (compute capability 8.9 or newer: Ada, Hopper) layers with quantized activations run
``torch._scaled_mm`` with the activations quantized by one Triton kernel (``fp8_triton``), except
at 1-4 rows, where a weight-only GEMV serves them without quantizing the activations
(``fp8_gemv``: W8A16, the more accurate; its module says what that means for batch invariance);
weight-only checkpoints and the CPU keep the emulation above. Older GPUs cannot multiply e4m3:
``loom plugins`` says so and ``--device cuda`` is refused there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from loom import kernel_switches
from loom.layers.fused_moe import FusedMoE
from loom.layers.linear import LinearBase
from loom.layers.quantized_input import FP8_MAX, expand_block_scales, row_scales  # noqa: F401  (FP8_MAX: the writers' and tests')
from loom.layers.quantized_input import to_e4m3 as quantize_fp8
from loom.plugin_api.moe import FusedMoEMethod
from loom.plugin_api.quantization import (
    LinearMethod,
    QuantizationConfig,
    QuantizationError,
    QuantizedRows,
    RowQuantization,
    WeightLoader,
    checkpoint_quantization_config,
    set_weight_attrs,
)

from . import fp8_gemv, fp8_triton
from .checkpoint_layers import checkpoint_tensor_names, quantized_parts
from .dequant_linear import (
    DequantLinearMethod,
    Kernel,
    QuantizeWhileLoading,
    WarmUp,
    per_part_parameter,
    rows_per_part,
)
from .fp8_moe import FP8CheckpointExperts, FP8ExpertsWhileLoading


def fp8_dtype() -> torch.dtype:
    return torch.float8_e4m3fn


def unsupported_reason() -> str | None:
    """Why FP8 cannot run on this machine: a torch without e4m3, or CUDA GPUs that are all older
    than compute capability 8.9 (a machine without GPUs runs the CPU emulation)."""
    if not hasattr(torch, "float8_e4m3fn"):
        return f"this torch ({torch.__version__}) has no float8_e4m3fn dtype (needs torch >= 2.1)"
    if torch.cuda.is_available():
        reasons = [fp8_triton.capability_reason(torch.device("cuda", i)) for i in range(torch.cuda.device_count())]
        if reasons and all(reasons):
            return reasons[0]
    return None


def fp8_kernel(layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The CUDA kernel of both FP8 methods (None: the emulation serves this call): at 1-4 rows the
    weight-only GEMV (``fp8_gemv``: W8A16, no activation quantization), else W8A8."""
    state = layer.__dict__.get("fp8_gpu")
    if state is None or not kernel_switches.fused_kernels or x.dtype != state.out_dtype:
        return None
    y = fp8_gemv.maybe_fp8_gemv(x, state.weight, state.scale_vector, bias)
    if y is not None or not state.shapes_ok:
        return y
    return fp8_triton.fp8_linear(x, state, bias)


def fp8_input_quantization(layer: Any, rows: int, dtype: torch.dtype) -> RowQuantization | None:
    """How :func:`fp8_kernel` would quantize ``rows`` rows in ``dtype`` (W8A8 on CUDA), or None: no
    CUDA state, the kernels off, another dtype, cuBLASLt's shapes not met, or 1-4 rows the GEMV
    takes dense (exactly the calls ``fp8_kernel`` hands to ``fp8_triton.fp8_linear``)."""
    state = layer.__dict__.get("fp8_gpu")
    if state is None or not kernel_switches.fused_kernels or dtype != state.out_dtype or not state.shapes_ok:
        return None
    if fp8_gemv.plan_for_rows(state.weight, rows, dtype) is not None:
        return None
    return RowQuantization(state.input_scale)


class FP8Forward:
    """What both FP8 methods do with input already quantized (``loom.layers.quantized_input``)."""

    def input_quantization(self, layer: Any, rows: int, dtype: torch.dtype) -> RowQuantization | None:
        return fp8_input_quantization(layer, rows, dtype)

    def apply_quantized(self, layer: Any, x: QuantizedRows, bias: torch.Tensor | None = None) -> torch.Tensor:
        state = layer.__dict__.get("fp8_gpu")
        if state is not None and x.codes.is_cuda:
            return fp8_triton.fp8_linear_quantized(x, state, bias)
        # The emulation: the codes times their scales are what transform_input would have made.
        return F.linear(x.dequantize(), self.dequantize(layer, x.dtype), bias)  # type: ignore[attr-defined]


def prepare_gpu(layer: Any, weight: torch.Tensor, channel_scale: torch.Tensor,
                input_scale: torch.Tensor | None) -> None:
    """On CUDA with Triton: the ``_scaled_mm`` operands (``channel_scale [out]``)."""
    if weight.device.type == "cuda" and fp8_triton.HAS_TRITON:
        fp8_triton.prepare(layer, weight.data, channel_scale, input_scale,
                           getattr(layer, "fp8_dtype", None) or torch.get_default_dtype())


def fake_quantize_activations(x: torch.Tensor, input_scale: torch.Tensor | None) -> torch.Tensor:
    """``x`` as a W8A8 kernel sees it: rounded to e4m3 with the static per-tensor ``input_scale``,
    or with per-token scales (each row's max |x| / 448) when it is None."""
    xf = x.float()
    scale = input_scale if input_scale is not None else row_scales(xf)
    return (quantize_fp8(xf, scale).float() * scale).to(x.dtype)


class FP8Scheme:
    """What a checkpoint's (or ``--quantize fp8``'s) FP8 quantization says."""

    def __init__(self, per_channel: bool, activations: str, block: tuple[int, int] | None = None,
                 scale_name: str = "weight_scale") -> None:
        self.per_channel = per_channel  # weight scales per output channel, else per tensor (part)
        self.activations = activations  # "static", "dynamic" or "none" (weight-only)
        self.block = block  # block-wise: one scale per (rows, inputs) block; computed weight-only
        self.scale_name = scale_name  # the scale tensor's name (block-wise FP8: weight_scale_inv)

    @classmethod
    def from_config(cls, qconfig: dict[str, Any]) -> FP8Scheme:
        method = str(qconfig.get("quant_method", "")).lower()
        if method == "fp8":  # vLLM / llm-compressor's older layout: per-tensor weight scales
            scheme = str(qconfig.get("activation_scheme", "dynamic"))
            if scheme not in ("static", "dynamic"):
                raise QuantizationError(f"FP8 quantization_config.activation_scheme is {scheme!r}; expected "
                                        "static or dynamic")
            if qconfig.get("weight_block_size") is not None:  # DeepSeek's / Qwen3's FP8 releases
                block = cls._block(qconfig["weight_block_size"], "quantization_config.weight_block_size")
                if scheme != "dynamic":
                    raise QuantizationError("FP8 quantization_config.activation_scheme is static with "
                                            "weight_block_size; block-wise FP8 checkpoints quantize activations "
                                            "dynamically")
                return cls(per_channel=False, activations="none", block=block, scale_name="weight_scale_inv")
            return cls(per_channel=False, activations=scheme)
        return cls._from_compressed_tensors(qconfig)

    @staticmethod
    def _block(value: Any, where: str) -> tuple[int, int]:
        """A ``[rows, inputs]`` block size (two positive integers)."""
        if not isinstance(value, (list, tuple)) or len(value) != 2 or not all(
                isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
            raise QuantizationError(f"FP8 {where} is {value!r}; expected two positive integers [rows, inputs]")
        return int(value[0]), int(value[1])

    @classmethod
    def _from_compressed_tensors(cls, qconfig: dict[str, Any]) -> FP8Scheme:
        fmt = qconfig.get("format")
        if fmt not in ("float-quantized", "naive-quantized"):
            raise QuantizationError(f"compressed-tensors quantization_config.format is {fmt!r}; supported: "
                                    "float-quantized (FP8, the fp8 quantizer) and pack-quantized (integer weights, "
                                    "the wna16 quantizer)")
        groups = qconfig.get("config_groups")
        if not isinstance(groups, dict) or len(groups) != 1:
            raise QuantizationError("compressed-tensors quantization_config.config_groups must hold exactly one "
                                    f"group (one scheme for every layer), got {len(groups or {})}")
        name, group = next(iter(groups.items()))
        where = f"compressed-tensors quantization_config.config_groups.{name}"
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise QuantizationError(f"{where}.weights is {weights.get('num_bits')}-bit {weights.get('type')!r}; "
                                    "only 8-bit float (FP8 e4m3) weights are supported")
        strategy = weights.get("strategy")
        if strategy not in ("tensor", "channel", "block"):
            raise QuantizationError(f"{where}.weights.strategy is {strategy!r}; supported: tensor, channel, block")
        if weights.get("dynamic"):
            raise QuantizationError(f"{where}.weights.dynamic is true; weight scales must be stored")
        acts = group.get("input_activations")
        if strategy == "block":  # LLM Compressor's FP8_BLOCK: computed weight-only, as the fp8 layout's blocks
            block = cls._block(weights.get("block_structure"), f"{where}.weights.block_structure")
            if acts is not None and not acts.get("dynamic"):
                raise QuantizationError(f"{where}.input_activations are static with block-wise weights; "
                                        "expected dynamic activations (or none)")
            return cls(per_channel=False, activations="none", block=block, scale_name="weight_scale")
        if acts is None:
            activations = "none"
        else:
            if acts.get("type") != "float" or acts.get("num_bits") != 8:
                raise QuantizationError(f"{where}.input_activations is {acts.get('num_bits')}-bit "
                                        f"{acts.get('type')!r}; only FP8 activations are supported")
            dynamic = bool(acts.get("dynamic"))
            act_strategy = acts.get("strategy")
            if dynamic and act_strategy not in ("token", "tensor"):
                raise QuantizationError(f"{where}.input_activations.strategy is {act_strategy!r}; dynamic "
                                        "activations are quantized per token")
            if not dynamic and act_strategy != "tensor":
                raise QuantizationError(f"{where}.input_activations.strategy is {act_strategy!r}; static "
                                        "activation scales must be per tensor")
            activations = "dynamic" if dynamic else "static"
        return cls(per_channel=strategy == "channel", activations=activations)


def rows_scale(layer: Any, scale: torch.Tensor) -> torch.Tensor:
    """Per-part scales ``[parts]`` -> one per output row ``[out, 1]``."""
    sizes = torch.tensor(rows_per_part(layer), device=scale.device)
    return scale.float().repeat_interleave(sizes).unsqueeze(1)


class FP8LinearMethod(FP8Forward, DequantLinearMethod):
    """An FP8 checkpoint's layer: ``weight`` e4m3, ``weight_scale``, optionally ``input_scale``."""

    kernels: ClassVar[dict[str, list[Kernel]]] = {"cuda": [fp8_kernel]}
    warm_ups: ClassVar[tuple[WarmUp, ...]] = (fp8_gemv.layer_warm_up_token_counts,)

    def __init__(self, scheme: FP8Scheme) -> None:
        self.scheme = scheme

    def create_weights(self, layer: Any, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        layer.fp8_dtype = params_dtype
        rows, parts = sum(output_partition_sizes), len(output_partition_sizes)
        weight = nn.Parameter(torch.empty(rows, input_size_per_partition, dtype=fp8_dtype()), requires_grad=False)
        set_weight_attrs(weight, output_dim=0, input_dim=1, weight_loader=self._checked(layer, weight_loader))
        layer.register_parameter("weight", weight)
        if self.scheme.per_channel:
            scale = nn.Parameter(torch.empty(rows, 1, dtype=torch.float32), requires_grad=False)
            set_weight_attrs(scale, output_dim=0, weight_loader=weight_loader)
            layer.register_parameter("weight_scale", scale)
        else:
            per_part_parameter(layer, "weight_scale", parts, (), torch.float32, fill=float("nan"))
        if self.scheme.activations == "static":
            per_part_parameter(layer, "input_scale", parts, (), torch.float32, fill=float("nan"))

    @staticmethod
    def _checked(layer: Any, weight_loader: WeightLoader) -> WeightLoader:
        def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
            if loaded.dtype != fp8_dtype():
                raise QuantizationError(f"FP8 {getattr(layer, 'prefix', '')}.weight is {loaded.dtype} in the "
                                        "checkpoint; expected float8_e4m3fn")
            weight_loader(param, loaded, shard_id)

        return load

    def process_weights_after_loading(self, layer: Any) -> None:
        for name in ("weight_scale", "input_scale"):
            value = getattr(layer, name, None)
            if value is not None and bool(torch.isnan(value).any()):
                raise QuantizationError(f"FP8 {getattr(layer, 'prefix', '')}: a part's {name} was not in the "
                                        "checkpoint")
        if self.scheme.activations == "static":  # one scale for the fused input: the largest part's
            layer.activation_scale = layer.input_scale.max().reshape(())
        if self.scheme.activations != "none":  # weight-only FP8 has no e4m3 activations to multiply
            scale = layer.weight_scale.float() if self.scheme.per_channel else rows_scale(layer, layer.weight_scale)
            prepare_gpu(layer, layer.weight, scale.reshape(-1),
                        layer.activation_scale if self.scheme.activations == "static" else None)

    def dequantize(self, layer: Any, dtype: torch.dtype) -> torch.Tensor:
        scale = layer.weight_scale.float() if self.scheme.per_channel else rows_scale(layer, layer.weight_scale)
        return (layer.weight.float() * scale).to(dtype)

    def transform_input(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        if self.scheme.activations == "none":
            return x
        return fake_quantize_activations(x, layer.activation_scale if self.scheme.activations == "static" else None)


def fp8_block_kernel(layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """A block-scaled layer's CUDA kernel at 1-4 rows (``fp8_gemv.maybe_fp8_block_gemv``: the FP8
    GEMV scaling each K tile by its blocks); None past that (the dequantizing path serves)."""
    method = layer.quant_method
    if not kernel_switches.fused_kernels:
        return None
    return fp8_gemv.maybe_fp8_block_gemv(x, layer.weight, getattr(layer, method.scale_name), method.block, bias)


def block_warm_up_token_counts(layer: Any, max_tokens: int) -> tuple[int, ...]:
    """The block GEMV's variants, as :func:`fp8_gemv.layer_warm_up_token_counts` (counts 1 and 2),
    on a layer whose weight is on a CUDA device."""
    weight = getattr(layer, "weight", None)
    if weight is None or not weight.is_cuda or not (kernel_switches.fp8_gemv and kernel_switches.fused_kernels):
        return ()
    return tuple(c for c in (1, 2) if c <= max_tokens)


class FP8BlockLinearMethod(DequantLinearMethod):
    """A block-wise FP8 checkpoint's layer (DeepSeek's and Qwen3's FP8 releases: ``weight``
    e4m3 and ``weight_scale_inv``, one float32 per block of bn rows x bk inputs; LLM Compressor's
    ``FP8_BLOCK`` names it ``weight_scale``): ``W = codes * scale[row // bn, col // bk]``,
    computed weight-only (dequantized, then the activations' own dtype).

    A fused layer's parts each have their grid of blocks, stacked as the rows are: so each part's
    rows (this rank's) must be whole blocks, and a row-parallel rank's inputs too; an unfused
    layer on one rank may end in a partial block (its grid rounded up).
    """

    kernels: ClassVar[dict[str, list[Kernel]]] = {"cuda": [fp8_block_kernel]}
    warm_ups: ClassVar[tuple[WarmUp, ...]] = (block_warm_up_token_counts,)

    def __init__(self, scheme: FP8Scheme) -> None:
        assert scheme.block is not None
        self.block = scheme.block
        self.scale_name = scheme.scale_name

    def create_weights(self, layer: Any, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        from loom.layers.linear import RowParallelLinear

        bn, bk = self.block
        prefix = getattr(layer, "prefix", "")
        rows = sum(output_partition_sizes)
        weight = nn.Parameter(torch.empty(rows, input_size_per_partition, dtype=fp8_dtype()), requires_grad=False)
        set_weight_attrs(weight, output_dim=0, input_dim=1,
                         weight_loader=FP8LinearMethod._checked(layer, weight_loader))
        layer.register_parameter("weight", weight)
        split = len(output_partition_sizes) > 1 or getattr(layer, "tp_size", 1) > 1
        hints: dict[str, Any] = {}
        if split and isinstance(layer, RowParallelLinear):
            if input_size_per_partition % bk:
                raise QuantizationError(f"FP8 {prefix}: this rank's {input_size_per_partition} inputs are not whole "
                                        f"blocks of {bk} (weight_block_size); use fewer shards")
            hints = {"input_dim": 1}
        elif split:
            ragged = [n for n in output_partition_sizes if n % bn]
            if ragged:
                raise QuantizationError(f"FP8 {prefix}: a part of {ragged[0]} rows is not whole blocks of {bn} "
                                        "(weight_block_size): its block scales cannot be told apart")
            hints = {"output_dim": 0, "packed_dim": 0, "packed_factor": bn}  # rows counted in blocks
        grid = (-(-rows // bn), -(-input_size_per_partition // bk))
        scale = nn.Parameter(torch.full(grid, float("nan")), requires_grad=False)
        set_weight_attrs(scale, weight_loader=weight_loader, **hints)
        layer.register_parameter(self.scale_name, scale)

    def process_weights_after_loading(self, layer: Any) -> None:
        if bool(torch.isnan(getattr(layer, self.scale_name)).any()):
            raise QuantizationError(f"FP8 {getattr(layer, 'prefix', '')}: a part's {self.scale_name} was not in the "
                                    "checkpoint")

    def dequantize(self, layer: Any, dtype: torch.dtype) -> torch.Tensor:
        w = layer.weight
        return (w.float() * expand_block_scales(getattr(layer, self.scale_name), self.block, *w.shape)).to(dtype)


class FP8WhileLoadingMethod(FP8Forward, QuantizeWhileLoading):
    """``--quantize fp8``: each dense weight, once its parts are in, becomes e4m3 with one scale
    per output channel; activations are quantized per token."""

    kernels: ClassVar[dict[str, list[Kernel]]] = {"cuda": [fp8_kernel]}
    warm_ups: ClassVar[tuple[WarmUp, ...]] = (fp8_gemv.layer_warm_up_token_counts,)

    def create_weights(self, layer: Any, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        layer.fp8_dtype = params_dtype
        super().create_weights(layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                               params_dtype, weight_loader)

    def quantize(self, layer: Any, weight: torch.Tensor) -> None:
        scale = row_scales(weight, dim=1)  # [out, 1]
        layer.register_buffer("weight_fp8", quantize_fp8(weight, scale))
        layer.register_buffer("weight_scale", scale)

    def process_weights_after_loading(self, layer: Any) -> None:
        super().process_weights_after_loading(layer)
        prepare_gpu(layer, layer.weight_fp8, layer.weight_scale.reshape(-1), None)

    def dequantize(self, layer: Any, dtype: torch.dtype) -> torch.Tensor:
        return (layer.weight_fp8.float() * layer.weight_scale).to(dtype)

    def transform_input(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        return fake_quantize_activations(x, None)


class FP8Config(QuantizationConfig):
    """FP8 checkpoints (every layer with a ``weight_scale``), or ``--quantize fp8`` on a dense one
    (every linear layer but the head)."""

    quant_methods = ("fp8", "compressed-tensors")
    quantizes_while_loading = True

    @classmethod
    def serves_checkpoint_config(cls, quantization_config: dict[str, Any]) -> bool:
        # compressed-tensors: FP8 weights only (pack-quantized integers are the wna16 quantizer's)
        return str(quantization_config.get("quant_method", "")).lower() == "fp8" or \
            quantization_config.get("format") in ("float-quantized", "naive-quantized")

    @classmethod
    def check_checkpoint_config(cls, quantization_config: dict[str, Any]) -> None:
        FP8Scheme.from_config(quantization_config)

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(model_dir, device, dtype)
        reason = unsupported_reason()
        if reason is None and device.type == "cuda":
            reason = fp8_triton.capability_reason(device)
        if reason:
            raise QuantizationError(reason)
        qconfig = checkpoint_quantization_config(model_dir)
        self.while_loading = qconfig is None
        self.scheme = FP8Scheme(per_channel=True, activations="dynamic") if qconfig is None else \
            FP8Scheme.from_config(qconfig)
        self.names = set() if qconfig is None else checkpoint_tensor_names(model_dir)
        self.scale_names: set[str] = set()
        self.unread_names: set[str] = set()  # experts' static input scales (the experts run weight-only)
        self.moe_layers = 0

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        if self.while_loading:
            return FP8WhileLoadingMethod() if isinstance(layer, LinearBase) else None
        required = ("input_scale",) if self.scheme.activations == "static" else ()
        marker = self.scheme.scale_name
        parts = quantized_parts(self, self.names, prefix, marker, required, "FP8")
        if parts is None:
            return None
        self.scale_names.update(f"{p}.{n}" for p in parts for n in ("weight", marker, "input_scale"))
        return FP8BlockLinearMethod(self.scheme) if self.scheme.block else FP8LinearMethod(self.scheme)

    def get_moe_method(self, layer: nn.Module, prefix: str) -> FusedMoEMethod | None:
        """A Mixture-of-Experts layer's experts in FP8 (``fp8_moe``): quantized while loading, or
        the checkpoint's when every expert projection has a ``weight_scale`` (None: none has one,
        the experts are dense)."""
        if not isinstance(layer, FusedMoE):
            return None
        if self.while_loading:
            self.moe_layers += 1
            return FP8ExpertsWhileLoading()
        marker = self.scheme.scale_name
        modules = [f"{prefix}.{e}.{name}" for e in range(layer.num_experts) for name in layer.checkpoint_names]
        have = [f"{m}.{marker}" in self.names for m in modules]
        if not any(have):
            return None
        if not all(have):
            dense = next(m for m, h in zip(modules, have, strict=True) if not h)
            raise QuantizationError(f"FP8 checkpoint: {dense} has no {marker} tensor while other experts of "
                                    f"{prefix} do (a layer's experts must all be quantized)")
        self.scale_names.update(f"{m}.{n}" for m in modules for n in ("weight", marker))
        self.unread_names.update(f"{m}.input_scale" for m in modules)
        self.moe_layers += 1
        return FP8CheckpointExperts(self.scheme.per_channel, self.scheme.block, marker)

    def keeps_checkpoint_dtype(self, name: str) -> bool:
        return name in self.scale_names

    def skips_checkpoint_tensor(self, name: str) -> bool:
        # Dynamic schemes need no activation scale (some tools still save one): not read. Nor are
        # the experts' static ones: experts compute weight-only (fp8_moe).
        return (self.scheme.activations != "static" and name.endswith(".input_scale")) or name in self.unread_names

    def settings(self) -> dict[str, str]:
        scales = "per channel" if self.scheme.per_channel else "per tensor"
        if self.scheme.block:
            scales = f"per block of {self.scheme.block[0]}x{self.scheme.block[1]}"
        settings = {"format": "while loading" if self.while_loading else "checkpoint", "weights": "float8_e4m3fn",
                    "weight_scales": scales, "activations": self.scheme.activations}
        if self.moe_layers:
            settings["experts"] = f"float8_e4m3fn weight-only ({self.moe_layers} layers)"
        return settings
