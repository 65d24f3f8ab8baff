"""Linear layers that load themselves: each parameter carries the loader that puts a checkpoint
tensor into this rank's slice of it.

A layer is built for one tensor-parallel rank (``loom.distributed.parallel_state``: today one
rank of one). Its quantization method, chosen at construction by the model's quantization config
(``loom.plugin_api.quantization``), creates the parameters; the layer supplies their
``weight_loader``, which reads the sharding hints the method attached to each parameter:

- ``output_dim``: the dimension of output features. A column-parallel layer keeps rows
  ``rank * n : (rank + 1) * n`` of it; fused layers (qkv, gate/up) keep that slice *of each part*
  at the part's place in the fused parameter.
- ``input_dim``: the dimension of input features. A row-parallel layer keeps this rank's slice
  of it; the partial products are summed over ranks (all-reduce) before the bias is added.
- ``packed_dim`` / ``packed_factor``: that dimension stores several logical values an element
  (8 int4 in an int32...): offsets and sizes along it are divided by the factor.

A hint of None means the parameter is the same on every rank (a per-tensor scale, a
row-parallel bias): it is copied whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from loom.distributed.parallel_state import all_reduce, get_tp_rank, get_tp_size
from loom.plugin_api.quantization import (
    LinearMethod,
    QuantizationConfig,
    QuantizedRows,
    RowQuantization,
    UnquantizedLinearMethod,
    set_weight_attrs,
)

if TYPE_CHECKING:
    from loom.lora.layers import LoraLayerWeights


class WeightShapeError(ValueError):
    """A checkpoint tensor does not have the shape the parameter expects (the loader adds the name)."""

    def __init__(self, checkpoint_shape: tuple[int, ...], expected_shape: tuple[int, ...]) -> None:
        super().__init__(f"checkpoint shape {checkpoint_shape}, expected {expected_shape}")
        self.checkpoint_shape = checkpoint_shape
        self.expected_shape = expected_shape


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
    """The whole tensor, same shape: norms, and every parameter the same on all ranks."""
    if tuple(param.shape) != tuple(loaded_weight.shape):
        raise WeightShapeError(tuple(loaded_weight.shape), tuple(param.shape))
    param.data.copy_(loaded_weight)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


def _stored(param: torch.Tensor, dim: int, n: int) -> int:
    """``n`` logical values along ``dim`` -> how many elements of ``param`` hold them."""
    if getattr(param, "packed_dim", None) != dim:
        return n
    factor = int(param.packed_factor)  # type: ignore[attr-defined]
    if n % factor:
        raise ValueError(f"{n} values along dimension {dim} do not fill whole packs of {factor}")
    return n // factor


def load_slice(dst: torch.Tensor, loaded: torch.Tensor, dim: int | None, start: int, full: int) -> None:
    """Copy ``loaded.narrow(dim, start, dst.shape[dim])`` into ``dst`` (``dim`` None: all of it),
    after checking that ``loaded`` is the whole checkpoint tensor: ``full`` long along ``dim``
    and ``dst``'s size along every other dimension."""
    if dim is None:
        default_weight_loader(dst, loaded)
        return
    expected = list(dst.shape)
    expected[dim] = full
    if list(loaded.shape) != expected:
        raise WeightShapeError(tuple(loaded.shape), tuple(expected))
    dst.copy_(loaded.narrow(dim, start, dst.shape[dim]))


class LinearBase(nn.Module):
    """``y = x @ W^T + b`` as its quantization method computes it; W's parameters are the method's.

    With LoRA adapters served (``loom.lora``), ``lora`` holds the layer's adapter slot tables and
    each row's adapter delta is added to the method's output, whatever the method."""

    lora: LoraLayerWeights | None = None

    def __init__(self, input_size: int, output_size: int, *, bias: bool, quant_config: QuantizationConfig | None,
                 prefix: str, input_size_per_partition: int, output_partition_sizes: list[int],
                 bias_rows: int | None, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.input_size, self.output_size, self.prefix = input_size, output_size, prefix
        self.input_size_per_partition = input_size_per_partition
        self.output_partition_sizes = output_partition_sizes
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        dtype = params_dtype or torch.get_default_dtype()
        method: LinearMethod | None = quant_config.get_linear_method(self, prefix) if quant_config else None
        self.quant_method: LinearMethod = method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, input_size_per_partition, output_partition_sizes, input_size,
                                         output_size, dtype, self.weight_loader)
        self.bias: nn.Parameter | None = None
        if bias:
            # Column-parallel layers keep their rows of the bias (output_dim 0); row-parallel ones
            # the whole bias, added once after the sum over ranks.
            rows = sum(output_partition_sizes) if bias_rows is None else bias_rows
            self.bias = nn.Parameter(torch.empty(rows, dtype=dtype), requires_grad=False)
            set_weight_attrs(self.bias, output_dim=0 if bias_rows is None else None, weight_loader=self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        raise NotImplementedError

    def input_quantization(self, rows: int, dtype: torch.dtype) -> RowQuantization | None:
        """How this layer would quantize an input of ``rows`` rows first, when whatever makes that
        input may quantize it instead (``loom.layers.quantized_input``); None with LoRA adapters,
        whose delta multiplies the dense input."""
        if self.lora is not None:
            return None
        return self.quant_method.input_quantization(self, rows, dtype)

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:  # [..., in] -> [..., out (this rank's)]
        if isinstance(x, QuantizedRows):  # as input_quantization said (never with adapters)
            return self.quant_method.apply_quantized(self, x, self.bias)
        out = self.quant_method.apply(self, x, self.bias)
        return out if self.lora is None else self.lora.add_to(x, out)

    def extra_repr(self) -> str:
        return (f"in_features={self.input_size_per_partition}, out_features={sum(self.output_partition_sizes)}, "
                f"bias={self.bias is not None}, tp={self.tp_rank}/{self.tp_size}, "
                f"method={type(self.quant_method).__name__}")


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__(input_size, output_size, bias=bias, quant_config=quant_config, prefix=prefix,
                         input_size_per_partition=input_size, output_partition_sizes=[output_size],
                         bias_rows=None, params_dtype=params_dtype)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        default_weight_loader(param, loaded_weight)


class ColumnParallelLinear(LinearBase):
    """Output features split over ranks: rank r computes rows ``r*n : (r+1)*n`` of W's output.
    The output stays split (the next layer is row-parallel), unless ``gather_output``."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 output_sizes: list[int] | None = None, params_dtype: torch.dtype | None = None) -> None:
        tp_size = get_tp_size()
        self.output_sizes = output_sizes or [output_size]  # the fused parts, unsharded
        partition_sizes = [divide(n, tp_size, f"{prefix or 'a linear layer'}'s output size")
                           for n in self.output_sizes]
        super().__init__(input_size, output_size, bias=bias, quant_config=quant_config, prefix=prefix,
                         input_size_per_partition=input_size, output_partition_sizes=partition_sizes,
                         bias_rows=None, params_dtype=params_dtype)

    def _load_part(self, param: torch.Tensor, loaded: torch.Tensor, offset: int, rows: int, start: int,
                   full: int) -> None:
        """This rank's ``rows`` of a part (from row ``start`` of the checkpoint tensor, ``full``
        rows long) into rows ``offset : offset + rows`` of the fused parameter; logical rows."""
        dim = getattr(param, "output_dim", None)
        if dim is None:
            default_weight_loader(param, loaded)
            return
        dst = param.data.narrow(dim, _stored(param, dim, offset), _stored(param, dim, rows))
        load_slice(dst, loaded, dim, _stored(param, dim, start), _stored(param, dim, full))

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        rows = self.output_partition_sizes[0]
        self._load_part(param, loaded_weight, 0, sum(self.output_partition_sizes), self.tp_rank * rows,
                        self.output_size)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers on one input, fused row-wise (gate and up: ``[gate | up]``).
    Each rank holds its slice of every part; ``shard_id`` i loads part i."""

    def __init__(self, input_size: int, output_sizes: list[int], *, bias: bool = True,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__(input_size, sum(output_sizes), bias=bias, quant_config=quant_config, prefix=prefix,
                         output_sizes=list(output_sizes), params_dtype=params_dtype)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is None:  # a checkpoint that stores the fused tensor: its parts one by one
            dim = getattr(param, "output_dim", None)
            if dim is None:
                default_weight_loader(param, loaded_weight)
                return
            stored = [_stored(param, dim, n) for n in self.output_sizes]
            if loaded_weight.shape[dim] != sum(stored):
                raise WeightShapeError(tuple(loaded_weight.shape), (sum(stored), *param.shape[1:]))
            for i, part in enumerate(loaded_weight.split(stored, dim=dim)):
                self.weight_loader(param, part, i)
            return
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"{self.prefix}: shard id {shard_id!r} is not a part index below {len(self.output_sizes)}")
        rows = self.output_partition_sizes[shard_id]
        offset = sum(self.output_partition_sizes[:shard_id])
        self._load_part(param, loaded_weight, offset, rows, self.tp_rank * rows, self.output_sizes[shard_id])


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections fused row-wise: ``[q | k | v]``, heads split over ranks.

    With fewer KV heads than ranks, each KV head is replicated on ``tp_size / num_kv_heads``
    consecutive ranks (every rank still has one); ``shard_id`` "q", "k" or "v" loads one part.
    """

    SHARDS = ("q", "k", "v")

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int, *,
                 bias: bool = True, quant_config: QuantizationConfig | None = None, prefix: str = "",
                 params_dtype: torch.dtype | None = None) -> None:
        tp_size = get_tp_size()
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size, f"{prefix or 'qkv'}'s number of attention heads")
        if tp_size >= total_num_kv_heads:
            if tp_size % total_num_kv_heads:
                raise ValueError(f"the tensor-parallel size {tp_size} is not a multiple of the "
                                 f"{total_num_kv_heads} KV heads")
            self.num_kv_heads, self.num_kv_head_replicas = 1, tp_size // total_num_kv_heads
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, f"{prefix or 'qkv'}'s number of KV heads")
            self.num_kv_head_replicas = 1
        q_rows, kv_rows = self.num_heads * head_size, self.num_kv_heads * head_size
        super().__init__(hidden_size, (total_num_heads + 2 * total_num_kv_heads) * head_size, bias=bias,
                         quant_config=quant_config, prefix=prefix, params_dtype=params_dtype,
                         # per-part sizes as if every rank had distinct heads: partition = size / tp
                         output_sizes=[q_rows * tp_size, kv_rows * tp_size, kv_rows * tp_size])

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        q_rows, kv_rows = self.output_partition_sizes[0], self.output_partition_sizes[1]
        q_total, kv_total = self.total_num_heads * self.head_size, self.total_num_kv_heads * self.head_size
        if shard_id is None:  # a checkpoint that stores qkv fused
            dim = getattr(param, "output_dim", None)
            if dim is None:
                default_weight_loader(param, loaded_weight)
                return
            stored = [_stored(param, dim, n) for n in (q_total, kv_total, kv_total)]
            if loaded_weight.shape[dim] != sum(stored):
                raise WeightShapeError(tuple(loaded_weight.shape), (sum(stored), *param.shape[1:]))
            for name, part in zip(self.SHARDS, loaded_weight.split(stored, dim=dim), strict=True):
                self.weight_loader(param, part, name)
            return
        if isinstance(shard_id, int) and 0 <= shard_id < 3:
            shard_id = self.SHARDS[shard_id]
        if shard_id == "q":
            self._load_part(param, loaded_weight, 0, q_rows, self.tp_rank * q_rows, q_total)
            return
        if shard_id not in ("k", "v"):
            raise ValueError(f"{self.prefix}: shard id {shard_id!r} is not one of q, k, v")
        # Ranks that share a KV head (replicas) read the same rows of k and v.
        start = (self.tp_rank // self.num_kv_head_replicas) * kv_rows
        offset = q_rows if shard_id == "k" else q_rows + kv_rows
        self._load_part(param, loaded_weight, offset, kv_rows, start, kv_total)


class RowParallelLinear(LinearBase):
    """Input features split over ranks: rank r multiplies its slice of x by its columns of W; the
    partial products are summed over ranks (all-reduce) and then the bias is added, once."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 input_is_parallel: bool = True, params_dtype: torch.dtype | None = None) -> None:
        tp_size = get_tp_size()
        self.input_is_parallel = input_is_parallel
        super().__init__(input_size, output_size, bias=bias, quant_config=quant_config, prefix=prefix,
                         input_size_per_partition=divide(input_size, tp_size, f"{prefix or 'a linear layer'}'s input size"),
                         output_partition_sizes=[output_size], bias_rows=output_size, params_dtype=params_dtype)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        dim = getattr(param, "input_dim", None)
        if dim is None:
            default_weight_loader(param, loaded_weight)
            return
        cols = param.shape[dim]
        load_slice(param.data, loaded_weight, dim, self.tp_rank * cols, cols * self.tp_size)

    def input_quantization(self, rows: int, dtype: torch.dtype) -> RowQuantization | None:
        if self.tp_size > 1 and not self.input_is_parallel:  # it takes its slice of a whole row
            return None
        return super().input_quantization(rows, dtype)

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:  # [..., in (this rank's, or all)] -> [..., out]
        if self.tp_size == 1:
            return super().forward(x)
        if isinstance(x, QuantizedRows):
            out = all_reduce(self.quant_method.apply_quantized(self, x, None))
            return out if self.bias is None else out + self.bias
        if not self.input_is_parallel:
            x = x.narrow(-1, self.tp_rank * self.input_size_per_partition, self.input_size_per_partition)
        out = all_reduce(self.quant_method.apply(self, x, None))
        return out if self.bias is None else out + self.bias
