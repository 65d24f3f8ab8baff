"""What the AWQ, GPTQ, FP8 and NF4 linear methods share: a dequantizing forward, per-part loading
of values kept once per fused part, and quantizing a dense weight while it loads.

Every method here can compute ``x @ W^T`` by dequantizing its layer's weight ``[out, in]`` in the
activations' dtype and calling ``F.linear``: that is the reference path, and the one the CPU
takes (speed there is not a goal; correctness is, so every method runs in the CPU test suite).
A method picks its kernel in :meth:`DequantLinearMethod.apply` by the activations' device: a
GPU kernel registers in ``kernels`` under the device type and is used when it accepts the call.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from loom.plugin_api.quantization import LinearMethod, QuantizationError, WeightLoader, set_weight_attrs

# kernel(layer, x, bias) -> y, or None when it does not take this call (shape, dtype...)
Kernel = Callable[[Any, torch.Tensor, "torch.Tensor | None"], "torch.Tensor | None"]
# warm_up(layer, max_tokens) -> the token counts that compile every variant of a kernel on the
# layer (empty when the kernel does not serve it): see LinearMethod.warm_up_token_counts
WarmUp = Callable[[Any, int], Sequence[int]]


class DequantLinearMethod(LinearMethod):
    """A quantized layer whose weight can be rebuilt densely; ``apply`` picks a kernel by device."""

    # device type -> kernels to try in order (GPU kernels plug in here); the dense path is last
    kernels: ClassVar[dict[str, list[Kernel]]] = {}
    # the warm-ups of those kernels that compile variants by token count
    warm_ups: ClassVar[tuple[WarmUp, ...]] = ()

    @abstractmethod
    def dequantize(self, layer: Any, dtype: torch.dtype) -> torch.Tensor:
        """The layer's weight ``[out, in]`` in ``dtype``, computed exactly in float32 first."""

    def warm_up_token_counts(self, layer: Any, max_tokens: int) -> Sequence[int]:
        counts: set[int] = set()
        for warm_up in self.warm_ups:
            counts.update(warm_up(layer, max_tokens))
        return sorted(counts)

    def transform_input(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        """What the kernel multiplies instead of ``x`` (FP8: the activations' own quantization)."""
        return x

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        for kernel in self.kernels.get(x.device.type, ()):
            y = kernel(layer, x, bias)
            if y is not None:
                return y
        return F.linear(self.transform_input(layer, x), self.dequantize(layer, x.dtype), bias)


def part_index(shard_id: object, num_parts: int, prefix: str) -> int:
    """A fused layer's shard id ("q"/"k"/"v", 0, 1...; None for an unfused one) as a part index."""
    if shard_id is None:
        return 0
    index = "qkv".index(shard_id) if isinstance(shard_id, str) and shard_id in ("q", "k", "v") else shard_id
    if not isinstance(index, int) or not 0 <= index < num_parts:
        raise QuantizationError(f"{prefix}: shard id {shard_id!r} is not one of its {num_parts} parts")
    return index


def per_part_parameter(layer: nn.Module, name: str, num_parts: int, shape: tuple[int, ...], dtype: torch.dtype,
                       fill: float = 0.0) -> nn.Parameter:
    """A value the checkpoint stores once per part (a per-tensor scale: ``shape`` ``()``): held as
    ``[num_parts, *shape]``, shard i's tensor loads into row i."""
    param = nn.Parameter(torch.full((num_parts, *shape), fill, dtype=dtype), requires_grad=False)
    prefix = str(getattr(layer, "prefix", ""))

    def load(target: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is None and num_parts > 1:  # a checkpoint that stores the fused layer: one value for all
            target.data.copy_(loaded.reshape(1, *shape).expand(num_parts, *shape))
            return
        row = target.data[part_index(shard_id, num_parts, prefix)]
        if loaded.numel() != row.numel():
            raise QuantizationError(f"{prefix}.{name}: checkpoint shape {tuple(loaded.shape)}, expected "
                                    f"{tuple(shape) or 'one value'}")
        row.copy_(loaded.reshape(row.shape))

    set_weight_attrs(param, weight_loader=load)
    layer.register_parameter(name, param)
    return param


def rows_per_part(layer: Any) -> list[int]:
    """Rows of each fused part (a head: one part, its vocabulary rows)."""
    sizes = getattr(layer, "output_partition_sizes", None)
    return list(sizes) if sizes is not None else [int(layer.shard.rows)]


class QuantizeWhileLoading(DequantLinearMethod):
    """A method that takes a dense checkpoint weight and quantizes it as soon as its layer's parts
    are all in: only one layer's dense weight is ever held (on the target device), never the model's.

    ``weight`` is an empty placeholder whose loader stages the parts; :meth:`quantize` turns the
    whole ``[out, in]`` weight into the layer's buffers.
    """

    quantizes_while_loading = True

    @abstractmethod
    def quantize(self, layer: Any, weight: torch.Tensor) -> None:
        """Register the layer's quantized buffers from its dense weight ``[out, in]``."""

    def create_weights(self, layer: Any, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        placeholder = nn.Parameter(torch.empty(0, dtype=params_dtype), requires_grad=False)
        rows, parts = sum(output_partition_sizes), len(output_partition_sizes)
        state: dict[str, Any] = {"staging": None, "loaded": set()}

        def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
            staging = state["staging"]
            if staging is None:
                staging = torch.empty(rows, input_size_per_partition, dtype=params_dtype, device=loaded.device)
                set_weight_attrs(staging, output_dim=0, input_dim=1)
                state["staging"] = staging
            weight_loader(staging, loaded, shard_id)
            state["loaded"].add(shard_id)
            if shard_id is None or len(state["loaded"]) == parts:
                self.quantize(layer, staging)
                state["staging"] = None  # the dense weight is dropped as soon as it is quantized

        set_weight_attrs(placeholder, weight_loader=load)
        layer.register_parameter("weight", placeholder)
        layer.quantized_while_loading = state

    def process_weights_after_loading(self, layer: Any) -> None:
        if "weight" in layer._parameters:
            del layer._parameters["weight"]
        if getattr(layer, "quantized_while_loading", {}).get("staging") is not None:
            raise QuantizationError(f"{getattr(layer, 'prefix', '')}: some parts of its weight were never loaded")
