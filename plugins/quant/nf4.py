"""The ``nf4`` quantizer: bitsandbytes NF4 checkpoints as transformers saves them
(``load_in_4bit``, with or without double quantization), and ``--quantize nf4``, which quantizes
a bf16 / fp16 / fp32 checkpoint while it loads.

A weight ``W [out, in]`` is flattened row-major and cut into blocks of ``blocksize`` (64); each
block keeps its max |w| (``absmax``, float32) and every weight a 4-bit code into the 16 NF4
values (``quant_map``): two codes a byte, the first in the high nibble. The checkpoint stores,
per linear ``X``:

- ``X.weight`` uint8 ``[out*in/2, 1]``; ``X.weight.absmax``; ``X.weight.quant_map`` float32 [16];
- ``X.weight.quant_state.bitsandbytes__nf4``: uint8 bytes of a JSON object (quant_type,
  blocksize, dtype, shape, and with double quantization nested_blocksize, nested_offset);
- double quantization: ``absmax`` is itself uint8 codes into ``X.weight.nested_quant_map`` (256
  values), with one float32 ``X.weight.nested_absmax`` per ``nested_blocksize`` (256) blocks:
  ``absmax = nested_quant_map[code] * nested_absmax[block // 256] + nested_offset``.

``W = quant_map[code] * absmax[block]`` in float32 (bitsandbytes' own order), then the model's
dtype. Loading decodes double-quantized absmax to float32 (0.5 bit a weight instead of 0.13) and
keeps each part of a fused layer (q, k, v...) in its own blocks.

Tensor parallelism: the flat blocks run along each row, so where no block straddles a cut (the
input size a multiple of the block size and, for a row-parallel layer, each rank's inputs too)
a rank cuts its rows (column-parallel) or its inputs (row-parallel) out of the codes viewed as
``[out, in / 2]`` and the float32 absmax as ``[out, in / blocksize]``; other shapes are refused
by name past one rank.

On a CUDA device with Triton, a layer whose blocks tile its rows (the input size a multiple of
the block size) is repacked at load into ``w4a16_layout`` (codes packed along the input, each
block's absmax as a group scale in the model's dtype, the 16 values as a table) and served by
Loom's kernels in ``w4a16_triton``; bitsandbytes is not needed (its own 4-bit matmul is the
tests' reference, not a fast path).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import structlog
import torch
from torch import nn

from loom.layers.linear import LinearBase
from loom.plugin_api.quantization import (
    LinearMethod,
    QuantizationConfig,
    QuantizationError,
    WeightLoader,
    checkpoint_quantization_config,
    set_weight_attrs,
)

from . import w4a16_triton
from .checkpoint_layers import bool_field, checkpoint_tensor_names, quantized_parts
from .dequant_linear import DequantLinearMethod, Kernel, QuantizeWhileLoading, WarmUp, part_index
from .w4a16_layout import NotRepackable, from_nf4_parts

log = structlog.get_logger(__name__)

# The 16 NF4 values (quantiles of a normal distribution scaled to [-1, 1], with an exact 0), as
# float32 numbers: the table bitsandbytes stores as quant_map.
NF4_VALUES = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)
BLOCKSIZE = 64
STATE_KEY = "quant_state.bitsandbytes__nf4"
_TINY = 1e-12
# checkpoint suffix (after ".weight.") -> the parameter name the model loads it under
_RENAMES = {"absmax": "weight_absmax", "quant_map": "weight_quant_map", "nested_absmax": "weight_nested_absmax",
            "nested_quant_map": "weight_nested_quant_map", STATE_KEY: "weight_quant_state"}


def nf4_table(device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor(NF4_VALUES, dtype=torch.float32, device=device)


def quantize_nf4(weight: torch.Tensor, blocksize: int = BLOCKSIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` (any shape) -> ``(packed uint8 [ceil(n/2)], absmax float32 [ceil(n/blocksize)])``:
    each block's max |w|, and each weight's nearest NF4 value of ``w / absmax``."""
    flat = weight.reshape(-1).float()
    n = flat.numel()
    blocks = -(-n // blocksize)
    padded = torch.zeros(blocks * blocksize, dtype=torch.float32, device=flat.device)
    padded[:n] = flat
    absmax = padded.view(blocks, blocksize).abs().amax(dim=1)  # [blocks]
    normalised = (padded.view(blocks, blocksize) / absmax.clamp(min=_TINY).unsqueeze(1)).reshape(-1)[:n]
    table = nf4_table(flat.device)
    thresholds = (table[1:] + table[:-1]) / 2  # between neighbouring values: nearest wins
    codes = torch.bucketize(normalised, thresholds).to(torch.uint8)
    if n % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    return (codes[0::2] << 4) | codes[1::2], absmax


def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, table: torch.Tensor, blocksize: int,
                   shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_nf4` (for any ``table``): float32 products, then ``dtype``."""
    flat = packed.reshape(-1)
    n = 1
    for d in shape:
        n *= d
    codes = torch.stack([flat >> 4, flat & 0xF], dim=1).reshape(-1)[:n].long()
    values = table.float()[codes]  # [n]
    scale = absmax.float().repeat_interleave(blocksize)[:n]
    return (values * scale).reshape(shape).to(dtype)


def decode_absmax(absmax: torch.Tensor, state: dict[str, Any], nested_absmax: torch.Tensor | None,
                  nested_table: torch.Tensor | None, where: str) -> torch.Tensor:
    """A part's per-block scales as float32: double-quantized ones decoded (bitsandbytes' order)."""
    if "nested_blocksize" not in state:
        if absmax.dtype != torch.float32:
            raise QuantizationError(f"NF4 {where}.weight.absmax is {absmax.dtype}; without double quantization "
                                    "it must be float32")
        return absmax
    if nested_absmax is None or nested_table is None:
        raise QuantizationError(f"NF4 {where}.weight.nested_absmax / nested_quant_map are missing though its "
                                "quant_state says the absmax is double-quantized")
    block = int(state["nested_blocksize"])
    scale = nested_absmax.float().repeat_interleave(block)[:absmax.numel()]
    decoded = nested_table.float()[absmax.reshape(-1).long()] * scale
    return decoded + torch.tensor(float(state.get("nested_offset", 0.0)), dtype=torch.float32)


def parse_bnb(qconfig: dict[str, Any]) -> bool:
    """Whether a bitsandbytes quantization_config uses double quantization; QuantizationError for
    what is not NF4."""
    if bool_field(qconfig, "load_in_8bit", False, "bitsandbytes"):
        raise QuantizationError("bitsandbytes quantization_config.load_in_8bit is true: LLM.int8 checkpoints are "
                                "not supported (4-bit NF4 ones are)")
    if not bool_field(qconfig, "load_in_4bit", True, "bitsandbytes"):
        raise QuantizationError("bitsandbytes quantization_config.load_in_4bit is false; expected a 4-bit NF4 "
                                "checkpoint")
    kind = qconfig.get("bnb_4bit_quant_type", "fp4")
    if kind != "nf4":
        raise QuantizationError(f"bitsandbytes quantization_config.bnb_4bit_quant_type is {kind!r}; only nf4 is "
                                "supported")
    storage = qconfig.get("bnb_4bit_quant_storage", "uint8")
    if storage != "uint8":
        raise QuantizationError(f"bitsandbytes quantization_config.bnb_4bit_quant_storage is {storage!r}; only "
                                "uint8 is supported")
    return bool_field(qconfig, "bnb_4bit_use_double_quant", False, "bitsandbytes")


class NF4Parts:
    """One layer's dequantization inputs, part by part (``nf4_codes_<i>``, ``nf4_absmax_<i>`` buffers)."""

    @staticmethod
    def register(layer: nn.Module, part: int, packed: torch.Tensor, absmax: torch.Tensor, table: torch.Tensor,
                 blocksize: int, shape: tuple[int, int]) -> None:
        layer.register_buffer(f"nf4_codes_{part}", packed.reshape(-1).contiguous())
        layer.register_buffer(f"nf4_absmax_{part}", absmax.reshape(-1).float().contiguous())
        layer.register_buffer(f"nf4_table_{part}", table.float().reshape(16).contiguous())
        meta = layer.__dict__.setdefault("nf4_parts", {})
        meta[part] = (blocksize, shape)

    @staticmethod
    def repack(layer: Any) -> None:
        """On CUDA with Triton: the parts become one kernel layout (their buffers are dropped)."""
        parts = sorted(layer.nf4_parts.items())
        codes = getattr(layer, f"nf4_codes_{parts[0][0]}")
        if not w4a16_triton.repacks_on(codes.device):
            return
        dtype = getattr(layer, "w4a16_dtype", None) or torch.get_default_dtype()
        try:
            layout = from_nf4_parts([(getattr(layer, f"nf4_codes_{i}"), getattr(layer, f"nf4_absmax_{i}"),
                                      getattr(layer, f"nf4_table_{i}"), blocksize, shape)
                                     for i, (blocksize, shape) in parts], dtype)
        except NotRepackable as exc:
            log.info("layer keeps the dequantizing path", layer=getattr(layer, "prefix", ""), reason=str(exc))
            return
        for i, _ in parts:
            for name in (f"nf4_codes_{i}", f"nf4_absmax_{i}", f"nf4_table_{i}"):
                del layer._buffers[name]
        layout.register(layer)

    @staticmethod
    def dequantize(layer: Any, dtype: torch.dtype) -> torch.Tensor:
        layout = layer.__dict__.get("w4a16")
        if layout is not None:
            return layout.dequantize(dtype)
        parts = [dequantize_nf4(getattr(layer, f"nf4_codes_{i}"), getattr(layer, f"nf4_absmax_{i}"),
                                getattr(layer, f"nf4_table_{i}"), blocksize, shape, torch.float32)
                 for i, (blocksize, shape) in sorted(layer.nf4_parts.items())]
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).to(dtype)


class NF4CheckpointMethod(DequantLinearMethod):
    """A bitsandbytes layer: its tensors are staged per part and decoded once a part is complete."""

    kernels: ClassVar[dict[str, list[Kernel]]] = {"cuda": [w4a16_triton.layer_kernel]}
    warm_ups: ClassVar[tuple[WarmUp, ...]] = (w4a16_triton.layer_warm_up_token_counts,)

    def __init__(self, double_quant: bool) -> None:
        self.keys = ["weight", "weight_absmax", "weight_quant_map", "weight_quant_state"]
        if double_quant:
            self.keys += ["weight_nested_absmax", "weight_nested_quant_map"]

    def create_weights(self, layer: Any, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        prefix = str(getattr(layer, "prefix", ""))
        layer.w4a16_dtype = params_dtype
        staged: dict[int, dict[str, torch.Tensor]] = {}
        parts = len(output_partition_sizes)

        def loader(key: str) -> WeightLoader:
            def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
                if shard_id is None and parts > 1:
                    raise QuantizationError(f"NF4 {prefix}: a fused {key} in the checkpoint cannot be split into "
                                            "its parts' blocks; save q/k/v and gate/up separately")
                part = part_index(shard_id, parts, prefix)
                staged.setdefault(part, {})[key] = loaded
                if len(staged[part]) == len(self.keys):
                    # weight_loader: the layer's own, which cuts a rank's rows / inputs (_rank_slice)
                    self._decode(layer, part, shard_id, staged.pop(part), output_partition_sizes,
                                 input_size_per_partition, input_size, weight_loader)
            return load

        for key in self.keys:
            placeholder = nn.Parameter(torch.empty(0), requires_grad=False)
            set_weight_attrs(placeholder, weight_loader=loader(key))
            layer.register_parameter(key, placeholder)
        layer.nf4_staged = staged

    def _decode(self, layer: Any, part: int, shard_id: object, tensors: dict[str, torch.Tensor],
                output_partition_sizes: list[int], cols: int, input_size: int,
                weight_loader: WeightLoader) -> None:
        """A part's complete tensors -> its NF4 buffers; past one rank, this rank's rows
        (``output_partition_sizes[part]``) and inputs (``cols`` of ``input_size``) of it."""
        prefix = str(getattr(layer, "prefix", ""))
        where = f"{prefix} part {part}" if len(getattr(layer, "output_partition_sizes", [1])) > 1 else prefix
        rows = output_partition_sizes[part]
        try:
            state = json.loads(bytes(tensors["weight_quant_state"].reshape(-1).tolist()).decode())
        except (ValueError, UnicodeDecodeError) as exc:
            raise QuantizationError(f"NF4 {where}.weight.{STATE_KEY} is not JSON: {exc}") from None
        if state.get("quant_type") != "nf4":
            raise QuantizationError(f"NF4 {where}.weight.{STATE_KEY}: quant_type is {state.get('quant_type')!r}, "
                                    "expected nf4")
        shape = tuple(int(d) for d in state.get("shape", ()))
        sharded = shape != (rows, cols)  # past one rank: the checkpoint's whole part, this rank's slice of it
        if len(shape) != 2 or (sharded and (shape[1] != input_size or int(getattr(layer, "tp_size", 1)) == 1)):
            raise QuantizationError(f"NF4 {where}: quant_state shape is {list(shape)}, expected [{rows}, {cols}]")
        full_rows, full_cols = shape
        blocksize = int(state.get("blocksize", BLOCKSIZE))
        packed = tensors["weight"]
        if packed.dtype != torch.uint8 or packed.numel() != -(-full_rows * full_cols // 2):
            raise QuantizationError(f"NF4 {where}.weight: {packed.dtype} with {packed.numel()} elements, expected "
                                    f"uint8 with {-(-full_rows * full_cols // 2)} (two 4-bit codes a byte)")
        absmax = decode_absmax(tensors["weight_absmax"], state, tensors.get("weight_nested_absmax"),
                               tensors.get("weight_nested_quant_map"), where)
        blocks = -(-full_rows * full_cols // blocksize)
        if absmax.numel() != blocks:
            raise QuantizationError(f"NF4 {where}.weight.absmax has {absmax.numel()} values, expected {blocks} "
                                    f"(one per block of {blocksize})")
        table = tensors["weight_quant_map"]
        if table.numel() != 16:
            raise QuantizationError(f"NF4 {where}.weight.quant_map has {table.numel()} values, expected 16")
        if sharded:
            packed, absmax = self._rank_slice(layer, where, shard_id, packed, absmax, blocksize, shape,
                                              output_partition_sizes, cols, weight_loader)
        NF4Parts.register(layer, part, packed, absmax, table, blocksize, (rows, cols))

    @staticmethod
    def _rank_slice(layer: Any, where: str, shard_id: object, packed: torch.Tensor, absmax: torch.Tensor,
                    blocksize: int, shape: tuple[int, ...], output_partition_sizes: list[int], cols: int,
                    weight_loader: WeightLoader) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows (column-parallel) or inputs (row-parallel) of a part stored flat.

        The flat blocks run along each row, so they can be cut only where no block straddles the
        cut: whole blocks per row (``in % blocksize == 0``) and, for a rank's inputs, whole blocks
        per rank (``cols % blocksize == 0``). Then the codes are ``[out, in / 2]`` bytes and the
        (already float32) absmax ``[out, in / blocksize]``, and the layer's own loader cuts them
        as it cuts a dense weight (its rows, KV-head replicas, its inputs)."""
        full_rows, full_cols = shape
        tp = int(getattr(layer, "tp_size", 1))
        if full_cols % blocksize:
            raise QuantizationError(f"NF4 {where}: --num-shard {tp} cannot split it: its {full_cols} inputs are "
                                    f"not whole NF4 blocks of {blocksize}, so blocks straddle its rows (serve it "
                                    "with --num-shard 1)")
        if cols % blocksize:
            raise QuantizationError(f"NF4 {where}: --num-shard {tp} leaves each rank {cols} of its {full_cols} "
                                    f"inputs, not whole NF4 blocks of {blocksize} (a rank's inputs must be a "
                                    f"multiple of {blocksize}; serve it with fewer shards or --num-shard 1)")
        rows = sum(output_partition_sizes)
        parts = len(output_partition_sizes)
        part = part_index(shard_id, parts, str(getattr(layer, "prefix", "")))
        offset = sum(output_partition_sizes[:part])
        # The layer's loader writes the part's slice at its rows of a fused [rows, ...] tensor.
        codes = torch.empty(rows, cols // 2, dtype=torch.uint8, device=packed.device)
        scales = torch.empty(rows, cols // blocksize, dtype=torch.float32, device=absmax.device)
        for dst, src in ((codes, packed.reshape(full_rows, full_cols // 2)),
                         (scales, absmax.reshape(full_rows, full_cols // blocksize))):
            set_weight_attrs(dst, output_dim=0, input_dim=1)
            weight_loader(dst, src, shard_id)
        mine = slice(offset, offset + output_partition_sizes[part])
        return codes[mine].reshape(-1).clone(), scales[mine].reshape(-1).clone()

    def process_weights_after_loading(self, layer: Any) -> None:
        prefix = str(getattr(layer, "prefix", ""))
        for key in self.keys:
            del layer._parameters[key]
        if layer.nf4_staged:
            part, tensors = next(iter(layer.nf4_staged.items()))
            missing = sorted(set(self.keys) - set(tensors))
            raise QuantizationError(f"NF4 {prefix} part {part}: checkpoint tensors missing: {', '.join(missing)}")
        parts = len(getattr(layer, "output_partition_sizes", [1]))
        if len(getattr(layer, "nf4_parts", {})) != parts:
            raise QuantizationError(f"NF4 {prefix}: not every part's weight was in the checkpoint")
        NF4Parts.repack(layer)

    def dequantize(self, layer: Any, dtype: torch.dtype) -> torch.Tensor:
        return NF4Parts.dequantize(layer, dtype)


class NF4WhileLoadingMethod(QuantizeWhileLoading):
    """``--quantize nf4``: each dense weight, once its parts are in, becomes NF4 blocks of 64."""

    kernels: ClassVar[dict[str, list[Kernel]]] = {"cuda": [w4a16_triton.layer_kernel]}
    warm_ups: ClassVar[tuple[WarmUp, ...]] = (w4a16_triton.layer_warm_up_token_counts,)

    def create_weights(self, layer: Any, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        layer.w4a16_dtype = params_dtype
        super().create_weights(layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                               params_dtype, weight_loader)

    def process_weights_after_loading(self, layer: Any) -> None:
        super().process_weights_after_loading(layer)
        NF4Parts.repack(layer)

    def quantize(self, layer: Any, weight: torch.Tensor) -> None:
        packed, absmax = quantize_nf4(weight)
        NF4Parts.register(layer, 0, packed, absmax, nf4_table(weight.device), BLOCKSIZE,
                          (weight.shape[0], weight.shape[1]))

    def dequantize(self, layer: Any, dtype: torch.dtype) -> torch.Tensor:
        return NF4Parts.dequantize(layer, dtype)


class NF4Config(QuantizationConfig):
    """bitsandbytes NF4 checkpoints (every layer with ``weight.absmax``), or ``--quantize nf4`` on a
    dense one (every linear layer but the head)."""

    quant_methods = ("bitsandbytes",)
    quantizes_while_loading = True

    @classmethod
    def check_checkpoint_config(cls, quantization_config: dict[str, Any]) -> None:
        parse_bnb(quantization_config)

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(model_dir, device, dtype)
        qconfig = checkpoint_quantization_config(model_dir)
        self.while_loading = qconfig is None
        self.double_quant = False if qconfig is None else parse_bnb(qconfig)
        self.names = set() if qconfig is None else checkpoint_tensor_names(model_dir)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        if self.while_loading:
            return NF4WhileLoadingMethod() if isinstance(layer, LinearBase) else None
        required = ["weight.quant_map", f"weight.{STATE_KEY}"]
        if self.double_quant:
            required += ["weight.nested_absmax", "weight.nested_quant_map"]
        if quantized_parts(self, self.names, prefix, "weight.absmax", tuple(required), "NF4") is None:
            return None
        return NF4CheckpointMethod(self.double_quant)

    def rename_checkpoint_tensor(self, name: str) -> str:
        stem, sep, suffix = name.partition(".weight.")
        if sep and suffix in _RENAMES:
            return f"{stem}.{_RENAMES[suffix]}"
        return name

    def keeps_checkpoint_dtype(self, name: str) -> bool:
        return ".weight." in name  # absmax, quant_map, nested_*: float32 in the format

    def settings(self) -> dict[str, str]:
        return {"format": "while loading" if self.while_loading else "bitsandbytes", "quant_type": "nf4",
                "blocksize": str(BLOCKSIZE) if self.while_loading else "from quant_state",
                "double_quant": str(self.double_quant).lower()}
