"""The contract of a linear-layer quantization method, and of the per-model config that picks it.

A quantizer plugin's ``QuantizerSpec.load()`` returns a :class:`QuantizationConfig` subclass.
The loader instantiates it for the checkpoint, the device and the dtype *before* the model is
built, and every linear layer asks it, while it is constructed, which :class:`LinearMethod`
serves it (``get_linear_method(layer, prefix)``, prefix being the layer's dotted name in the
model, e.g. ``model.layers.3.self_attn.qkv_proj``). A method then owns the layer's weights over
their whole life:

1. ``create_weights``: register the parameters the checkpoint holds for this layer (a dense
   ``weight``; or packed ``qweight`` / ``scales`` / ``qzeros``...), each with the layer's
   ``weight_loader`` and the attributes that tell it how to shard (see ``loom.layers.linear``);
2. the model's ``load_weights`` streams checkpoint tensors into those parameters;
3. ``process_weights_after_loading``: repack for a kernel, drop what the kernel does not read;
4. ``apply``: the layer's forward, ``x @ W^T + bias`` in whatever form W is kept.

Layers for which the config returns None stay dense (:class:`UnquantizedLinearMethod`).

``--quantize``: ``auto`` applies the quantizer whose format the checkpoint itself carries: the one
that serves config.json's ``quantization_config.quant_method`` (GPTQ, AWQ, FP8, bitsandbytes
NF4: there are no dense weights, so it must run or the model does not load), or a GGUF file's
blocks on the CPU, when it can run here (otherwise the dense weights serve); ``none`` keeps dense
weights (refused for a checkpoint that has none); a name applies that quantizer: the
checkpoint's own format, or a quantizer that ``quantizes_while_loading`` a dense checkpoint
(``fp8``, ``nf4``), or fails saying why it cannot.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

# weight_loader(param, loaded_weight, shard_id=None): copy a checkpoint tensor (the whole
# unsharded tensor, or one part of a fused one: shard_id "q"/"k"/"v" or 0, 1, ...) into this
# rank's slice of ``param``.
WeightLoader = Callable[..., None]


class QuantizationError(Exception):
    """A quantizer cannot serve this model here; the message says why."""


def checkpoint_quantization_config(model_dir: Path) -> dict[str, Any] | None:
    """config.json's ``quantization_config`` (or an older GPTQ repo's ``quantize_config.json``,
    whose method is gptq), or None for a dense checkpoint."""
    config_path = Path(model_dir) / "config.json"
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError) as exc:
            raise QuantizationError(f"cannot read {config_path}: {exc}") from exc
        value = config.get("quantization_config") if isinstance(config, dict) else None
        if value is not None:
            if not isinstance(value, dict):
                raise QuantizationError(f"config.json quantization_config must be an object, got {value!r}")
            return dict(value)
    legacy = Path(model_dir) / "quantize_config.json"
    if legacy.is_file():
        value = json.loads(legacy.read_text())
        return {"quant_method": "gptq", **value} if isinstance(value, dict) else None
    return None


def checkpoint_quant_method(model_dir: Path) -> str | None:
    """The checkpoint's ``quantization_config.quant_method`` (lower case), None for dense weights."""
    config = checkpoint_quantization_config(model_dir)
    if config is None:
        return None
    method = config.get("quant_method")
    if not isinstance(method, str) or not method:
        raise QuantizationError(f"config.json quantization_config has no quant_method string (got {method!r})")
    return method.lower()


def set_weight_attrs(param: torch.Tensor, **attrs: Any) -> None:
    """Attach loading hints to a parameter: ``weight_loader``; ``output_dim`` / ``input_dim``
    (the dimension that is split across ranks for column- / row-parallel layers, None: not
    split); ``packed_dim`` and ``packed_factor`` (that dimension holds ``packed_factor`` logical
    values per element, e.g. 8 int4 in an int32, so shard sizes along it are divided by it)."""
    for key, value in attrs.items():
        if hasattr(param, key) and getattr(param, key) is not value:
            raise AttributeError(f"parameter already has attribute {key!r}")
        setattr(param, key, value)


@dataclass(frozen=True)
class RowQuantization:
    """How a layer's kernel quantizes its input before multiplying (FP8 W8A8): each row to e4m3
    with the row's own scale (``max |x| / 448``, at least 1e-12), or with one ``static_scale``
    (``[1]`` float32) for every row; codes ``clamp(x / scale, -448, 448)`` rounded to nearest even."""

    static_scale: torch.Tensor | None = None


@dataclass(frozen=True)
class QuantizedRows:
    """A linear layer's input, already quantized as its :class:`RowQuantization` says, by the kernel
    that produced it (the RMSNorm before qkv and gate/up, the SiLU-and-mul before down): the same
    codes the layer would make itself, without its own pass over the activations."""

    codes: torch.Tensor  # [T, K] float8_e4m3fn, contiguous
    scales: torch.Tensor  # [T, 1] float32 (every row the static scale when there is one)
    dtype: torch.dtype  # the dense activations' dtype: the layer's output dtype

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        """The dense activations the layer multiplies (``codes * scale`` in ``dtype``)."""
        return (self.codes.float() * self.scales).to(self.dtype)


class LinearMethod(ABC):
    """How one linear layer keeps and multiplies its weight. One instance may serve many layers:
    everything per layer lives on the layer."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        """Register the layer's parameters. ``output_partition_sizes``: this rank's rows of each
        fused part (one entry for an unfused layer); ``input_size`` / ``output_size``: the whole
        layer's, before sharding."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 - optional hook
        """Called once every checkpoint tensor is in: repack for the kernel (default: nothing)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., in] -> [..., out]``: this rank's part of ``x @ W^T (+ bias)``."""

    def input_quantization(self, layer: nn.Module, rows: int, dtype: torch.dtype) -> RowQuantization | None:
        """How :meth:`apply` would quantize an input of ``rows`` rows in ``dtype`` as its first step,
        if it would (FP8 W8A8 on CUDA); then the kernel producing that input may quantize it
        instead and call :meth:`apply_quantized` (one pass over the activations fewer). Asked on
        every forward (by rows: CUDA-graph safe). Default: None, the layer takes dense input."""
        return None

    def apply_quantized(self, layer: nn.Module, x: QuantizedRows, bias: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`apply` on input quantized as :meth:`input_quantization` said; a method that says
        something there implements this."""
        raise NotImplementedError(f"{type(self).__name__} takes no pre-quantized input")

    def warm_up_token_counts(self, layer: nn.Module, max_tokens: int) -> Sequence[int]:
        """Token counts (each at most ``max_tokens``) at which one call of :meth:`apply` each
        compiles every GPU kernel variant that a call of any count from 1 to ``max_tokens`` would
        launch on this layer: for kernels chosen or specialised by the number of rows (Triton
        compiles a variant per tile plan and per class of an integer argument: 1, a multiple of
        16, other), a second or more each. A worker runs its model at these counts before the
        server reports SERVING, so that nothing compiles while serving. Default: none (cuBLAS,
        CPU code, and kernels whose compiled code does not depend on the count)."""
        return ()


class UnquantizedLinearMethod(LinearMethod):
    """The dense path: one ``weight [out, in]`` in the model's dtype, ``F.linear``; on CUDA, the
    1-4 row calls of the shapes a measured table names run Loom's Triton GEMV instead
    (``loom.layers.dense_gemv``: where it beats cuBLAS; ``LOOM_DENSE_GEMV=0`` turns it off)."""

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        weight = nn.Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
                              requires_grad=False)
        set_weight_attrs(weight, input_dim=1, output_dim=0, weight_loader=weight_loader)
        layer.register_parameter("weight", weight)

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.is_cuda:
            from loom.layers.dense_gemv import maybe_dense_gemv

            out = maybe_dense_gemv(x, layer.weight, bias)
            if out is not None:
                return out
        return F.linear(x, layer.weight, bias)


class QuantizationConfig(ABC):
    """One checkpoint's quantization: which method serves each linear layer.

    Subclasses are what ``QuantizerSpec.load()`` returns. The loader sets
    ``packed_modules_mapping`` from the model class before building it (fused module -> the
    checkpoint modules it holds, e.g. ``qkv_proj -> [q_proj, k_proj, v_proj]``), so a config that
    reads per-tensor metadata can find a fused layer's parts.
    """

    packed_modules_mapping: dict[str, list[str]]
    # config.json ``quantization_config.quant_method`` values whose checkpoints this config serves
    # (a checkpoint naming one holds no dense weights: --quantize auto must use it or refuse).
    quant_methods: ClassVar[tuple[str, ...]] = ()
    # True: ``--quantize NAME`` on a dense checkpoint quantizes each layer while it loads.
    quantizes_while_loading: ClassVar[bool] = False
    # True: ``--quantize NAME`` on a random-weight model (``random:NAME``, benchmarks) quantizes
    # the drawn weights while they load, though a dense checkpoint is refused (GPTQ and AWQ need
    # their calibrated checkpoints; random weights need only the format, for speed).
    quantizes_random_weights: ClassVar[bool] = False

    @classmethod
    def for_checkpoint(cls, model_dir: Path) -> bool:
        """True when the checkpoint carries weights in this quantizer's own format. By default:
        config.json's ``quantization_config.quant_method`` is one of :attr:`quant_methods`
        (case-insensitive) and :meth:`serves_checkpoint_config` takes it; a format told otherwise
        (a GGUF file) overrides it."""
        qconfig = checkpoint_quantization_config(model_dir)
        return qconfig is not None and str(qconfig.get("quant_method", "")).lower() in cls.quant_methods \
            and cls.serves_checkpoint_config(qconfig)

    @classmethod
    def serves_checkpoint_config(cls, quantization_config: dict[str, Any]) -> bool:
        """Whether this config is the one for a ``quantization_config`` of one of its
        :attr:`quant_methods`, where several quantizers share a method and split it by another
        field (compressed-tensors: ``format`` float-quantized is FP8's, pack-quantized integer
        weights another's). True by default; where no claimant takes a config, the first one's
        :meth:`check_checkpoint_config` says why."""
        return True

    @classmethod
    def check_checkpoint_config(cls, quantization_config: dict[str, Any]) -> None:
        """Raise QuantizationError (one sentence naming the field and what was expected) for a
        ``quantization_config`` of one of ``quant_methods`` that this config cannot serve. Only
        config.json is read: ``loom serve`` calls it before anything loads."""
        return None  # a config class with nothing to check

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> None:
        """Raises QuantizationError when it cannot serve this model on ``device`` in ``dtype``."""
        self.packed_modules_mapping = {}

    @abstractmethod
    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        """The method for the layer being built at ``prefix``; None: the dense path serves it."""

    def checkpoint_parts(self, prefix: str) -> list[str]:
        """The checkpoint modules whose rows make up the layer at ``prefix``, in row order."""
        parent, _, leaf = prefix.rpartition(".")
        return [f"{parent}.{part}" if parent else part for part in self.packed_modules_mapping.get(leaf, [leaf])]

    def settings(self) -> dict[str, str]:
        """What GetModelInfo reports about this quantization (bits, group size, format...)."""
        return {}

    def rename_checkpoint_tensor(self, name: str) -> str:
        """The name under which the model loads checkpoint tensor ``name`` (default: the same).
        A format whose per-layer tensors are not ``<module>.<param>`` (bitsandbytes'
        ``<module>.weight.absmax``) maps them to parameters its method registered."""
        return name

    def keeps_checkpoint_dtype(self, name: str) -> bool:
        """True for a floating checkpoint tensor that loads in its own dtype rather than the
        model's (a format's fp16 / fp32 scales; float8 payloads always keep theirs)."""
        return False

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """True for a checkpoint tensor the model must not load because a method of this config
        gets that layer's weights elsewhere (see ``extra_checkpoint_weights``)."""
        return False

    def extra_checkpoint_weights(self, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors to load beside the checkpoint's own, under the names the model loads."""
        return iter(())
