"""The ``gguf`` quantizer: a GGUF file's Q4_0, Q4_1, Q4_K and Q8_0 weights computed in their blocks.

The model loader keeps the file's block bytes beside the dequantized checkpoint
(``loom.model_loader.gguf_cache``), each verified to dequantize exactly to the dense tensor.
:class:`GGUFConfig` gives every linear layer whose parts all have blocks of one kernel type the
:class:`GGUFLinearMethod`: the layer's parameter is ``blocks`` (the file's bytes, ``[out, row
bytes]`` uint8, loaded from ``gguf_blocks.safetensors`` through the layer's own weight loader:
fused projections (qkv, gate/up) take their parts' rows), never the dense weight. After loading,
the blocks are regrouped for the CPU kernel (``csrc/gguf_linear_cpu.cpp``), which dequantizes in
registers with gguf-py's own float operations: the weights multiplied are the dense model's, bit
for bit, read from 0.625-0.75 (4-bit) or 1.125 (Q8_0) bytes each instead of 4. A tied model's
head gets the embedding's blocks (lookups stay dense). :class:`GGUFLinear` is the same kernel as
a stand-alone module.

fp32 activations on an x86-64 CPU with AVX2 and FMA. On other devices, with ``--dtype`` other
than float32, or for other block types (Q6_K, Q5_K, ...: a fused layer with such a part too, or
with parts of two GGUF types), the dense weights serve (``--quantize auto`` falls back silently;
``--quantize gguf`` fails saying why).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.nn.functional as F
from torch import nn

from loom.cpu_extension import CpuExtension, cpu_flags, kernels_enabled
from loom.distributed.parallel_state import get_tp_size
from loom.model_loader.gguf_cache import BLOCKS_FILE
from loom.plugin_api.quantization import (
    LinearMethod,
    QuantizationConfig,
    QuantizationError,
    WeightLoader,
    set_weight_attrs,
)

log = structlog.get_logger(__name__)

# The file's block types the kernel computes, and the kernel format each is served in: Q4_0 and
# Q8_0 as they are; Q4_1 and Q4_K both as w = d * q + m over blocks of 32 4-bit values (Q4_K's
# per-32 scale d * sc and minimum -(dmin * m) computed here in float32 as gguf-py computes them,
# and x - y is x + (-y) exactly: the same weights).
KERNEL_TYPE = {"Q4_0": 2, "Q4_1": 3, "Q4_K": 3, "Q8_0": 8}
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144}
_BLOCK_WEIGHTS = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "Q4_K": 256}
QK = 32
# From this many rows on, a GEMM on the dequantized weight (MKL) serves instead of the kernel.
# Below it, every row's sums run in one order, whatever the batch.
DENSE_ROWS = 1024

_KERNEL = CpuExtension("loom_gguf_linear", Path(__file__).parent / "csrc" / "gguf_linear_cpu.cpp",
                       namespace="loom_gguf_cpu", op="linear", extra_cflags=["-ffp-contract=off"],
                       usual_build_s=15)  # 9.9-21.9 s measured on 2 cores (busy or not)


def cpu_unsupported_reason() -> str | None:
    """Why this CPU cannot run the kernel (None: it can, once built)."""
    flags = cpu_flags().split()
    if not {"avx2", "fma", "f16c"} <= set(flags):
        return "needs an x86-64 CPU with AVX2, FMA and F16C"
    if not kernels_enabled():
        return "LOOM_CPU_KERNELS=0"
    return None


def kernel_available() -> bool:
    return cpu_unsupported_reason() is None and _KERNEL.available()


@dataclass
class Unpacked:
    """A weight's blocks, row by row: the kernel's numbers before they are grouped by 8 rows."""

    q: torch.Tensor  # [N, K]: 4-bit values as uint8, or int8 (Q8_0), in k order
    d: torch.Tensor  # [N, K/32] float32: each block of 32's scale
    m: torch.Tensor | None  # [N, K/32] float32: each block's minimum (kernel type Q4_1), else None
    qtype: int  # the kernel's type id


def _halves(blocks: torch.Tensor, col: int) -> torch.Tensor:  # the fp16 at byte col of every block, float32
    return blocks[:, :, col:col + 2].contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(payload: torch.Tensor) -> torch.Tensor:
    """Bytes [..., 32c + i] of 32-byte runs -> values: a run's low nibbles, then its high ones."""
    return torch.stack([payload & 0xF, payload >> 4], dim=-2)


def unpack(raw: torch.Tensor, type_name: str) -> Unpacked:
    """The file's blocks ``raw`` [N, row bytes] uint8 as the kernel's numbers (see ``KERNEL_TYPE``)."""
    if type_name not in KERNEL_TYPE:
        raise QuantizationError(f"GGUF type {type_name} has no kernel (supported: {', '.join(KERNEL_TYPE)})")
    n, row_bytes = raw.shape
    bb = _BLOCK_BYTES[type_name]
    blocks = raw.reshape(n, row_bytes // bb, bb)
    if type_name == "Q8_0":
        return Unpacked(blocks[:, :, 2:].contiguous().view(torch.int8).reshape(n, -1), _halves(blocks, 0), None, 8)
    if type_name in ("Q4_0", "Q4_1"):
        # A block's weight j < 16 is the low nibble of its byte j, weight j >= 16 the high nibble of byte j - 16.
        payload = blocks[:, :, (4 if type_name == "Q4_1" else 2):]
        m = _halves(blocks, 2) if type_name == "Q4_1" else None
        return Unpacked(_nibbles(payload).reshape(n, -1), _halves(blocks, 0), m, KERNEL_TYPE[type_name])
    # Q4_K: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and minimums for its 8 blocks of 32, then
    # 128 bytes: four runs of 32, each holding two blocks (low nibbles, then high ones).
    scales = blocks[:, :, 4:16].reshape(n, -1, 3, 4)
    lo, mid, hi = scales[:, :, 0], scales[:, :, 1], scales[:, :, 2]
    sc = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], dim=-1).float()  # [N, nb, 8]
    mins = torch.cat([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], dim=-1).float()
    d = _halves(blocks, 0).unsqueeze(-1) * sc  # gguf-py: d * sc, then d * q - dmin * m
    dm = _halves(blocks, 2).unsqueeze(-1) * mins
    q = _nibbles(blocks[:, :, 16:].reshape(n, -1, 4, 32)).reshape(n, -1)
    return Unpacked(q, d.reshape(n, -1), (-dm).reshape(n, -1), 3)


def pack(parts: list[Unpacked]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Row-concatenated parts (one kernel type) -> the kernel's (qs, d, m, type).

    Output columns (rows of W) go in groups of 8, padded: qs [G, K/2, 8] uint8 holding weights
    2p and 2p+1 in the low and high nibble, or [G, K, 8] int8 (Q8_0); d and m [G, K/32, 8]
    float32 (m is empty unless the kernel type is Q4_1). See the .cpp file for the formulas.
    """
    qtype = parts[0].qtype
    if any(p.qtype != qtype for p in parts):
        raise QuantizationError("the parts of a fused layer are in different kernel formats")
    q = torch.cat([p.q for p in parts])
    n = q.shape[0]
    groups = (n + 7) // 8
    pad = groups * 8 - n

    def grouped(t: torch.Tensor) -> torch.Tensor:  # [N, C] -> [G, C, 8], zero rows padding
        return nn.functional.pad(t, (0, 0, 0, pad)).reshape(groups, 8, t.shape[1]).transpose(1, 2).contiguous()

    d = grouped(torch.cat([p.d for p in parts]))
    m = grouped(torch.cat([p.m for p in parts if p.m is not None])) if qtype == 3 else torch.empty(0, 0, 0)
    qg = grouped(q)  # [G, K, 8]
    qs = qg if qtype == 8 else (qg[:, 0::2, :] | (qg[:, 1::2, :] << 4)).contiguous()
    return qs, d, m, qtype


def gguf_linear(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor, qtype: int,
                out_features: int, in_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [..., in] @ W^T (+ bias)`` with W in the kernel's packed blocks (see :func:`pack`)."""
    lead = x.shape[:-1]
    # [M, in]; a model's activations are already 2-D and contiguous: no reshape op then
    x2 = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, in_features).contiguous()
    if x2.shape[0] >= DENSE_ROWS:
        # Prefill-sized: the weights are read once per many rows, so bytes no longer matter
        # and MKL's GEMM beats the kernel there (by up to 1.2x at 4096 rows on 2 cores).
        # Dequantizing costs one pass over the weight, about 0.1% of the GEMM.
        return F.linear(x2, dequantize(qs, d, m, qtype, out_features), bias).view(*lead, out_features)
    y: torch.Tensor = torch.ops.loom_gguf_cpu.linear(x2, qs, d, m, qtype, out_features)
    if bias is not None:
        y.add_(bias)
    return y if x2 is x else y.view(*lead, out_features)


def dequantize(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor, qtype: int, out_features: int) -> torch.Tensor:
    """The packed blocks' weight ``[out, in]`` float32: the dense weight, exactly."""
    w: torch.Tensor = torch.ops.loom_gguf_cpu.dequantize(qs, d, m, qtype, out_features)
    return w


class GGUFLinear(nn.Module):
    """``y = x @ W^T (+ bias)`` with W kept in GGUF blocks; x fp32 on the CPU (a stand-alone module)."""

    qs: torch.Tensor  # buffers: the kernel's packed blocks (see pack)
    d: torch.Tensor
    m: torch.Tensor

    def __init__(self, parts: list[Unpacked], in_features: int, bias: torch.Tensor | None,
                 type_names: str) -> None:
        super().__init__()
        qs, d, m, self.qtype = pack(parts)
        self.type_name = type_names
        self.out_features, self.in_features = sum(p.q.shape[0] for p in parts), in_features
        if d.shape[1] * QK != in_features:
            raise QuantizationError(f"blocks hold {d.shape[1] * QK} inputs, the layer has {in_features}")
        self.register_buffer("qs", qs)
        self.register_buffer("d", d)
        self.register_buffer("m", m)
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None

    @classmethod
    def from_blocks(cls, raw: torch.Tensor, type_name: str, in_features: int,
                    bias: torch.Tensor | None = None) -> GGUFLinear:
        """One weight's blocks ``raw`` [out, row bytes] of GGUF type ``type_name``."""
        return cls([unpack(raw, type_name)], in_features, bias, type_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return gguf_linear(x, self.qs, self.d, self.m, self.qtype, self.out_features, self.in_features, self.bias)

    def dequantized_weight(self) -> torch.Tensor:  # [out, in] float32: the dense weight, exactly
        return dequantize(self.qs, self.d, self.m, self.qtype, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, type={self.type_name}, " \
               f"bias={self.bias is not None}"


class GGUFLinearMethod(LinearMethod):
    """A layer whose parts all have blocks of GGUF type ``type_name``: ``blocks`` [out, row bytes]
    uint8 are loaded, then regrouped into the kernel's ``qs``, ``d``, ``m`` buffers."""

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name

    def create_weights(self, layer: Any, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        row_bytes = input_size_per_partition // _BLOCK_WEIGHTS[self.type_name] * _BLOCK_BYTES[self.type_name]
        blocks = nn.Parameter(torch.empty(sum(output_partition_sizes), row_bytes, dtype=torch.uint8),
                              requires_grad=False)
        # Rows are output features (fused parts at their offsets); a row's bytes are not split.
        set_weight_attrs(blocks, output_dim=0, input_dim=None, weight_loader=weight_loader)
        layer.register_parameter("blocks", blocks)
        layer.gguf_shape = (sum(output_partition_sizes), input_size_per_partition)  # (out, in)

    def process_weights_after_loading(self, layer: Any) -> None:
        # Unpacking works row by row, so the fused rows unpack as their parts would one by one.
        qs, d, m, qtype = pack([unpack(layer.blocks.data, self.type_name)])
        del layer.blocks
        layer.register_buffer("qs", qs)
        layer.register_buffer("d", d)
        layer.register_buffer("m", m)
        layer.gguf_qtype = qtype

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out_features, in_features = layer.gguf_shape
        return gguf_linear(x, layer.qs, layer.d, layer.m, layer.gguf_qtype, out_features, in_features, bias)

    def dequantized_weight(self, layer: Any) -> torch.Tensor:  # [out, in] float32: the dense weight, exactly
        return dequantize(layer.qs, layer.d, layer.m, layer.gguf_qtype, layer.gguf_shape[0])


class GGUFConfig(QuantizationConfig):
    """The GGUF blocks kept beside a converted checkpoint, for every layer whose parts have them."""

    @classmethod
    def for_checkpoint(cls, model_dir: Path) -> bool:
        return (Path(model_dir) / BLOCKS_FILE).is_file()

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(model_dir, device, dtype)
        self.path = Path(model_dir) / BLOCKS_FILE
        if not self.path.is_file():
            raise QuantizationError(f"{model_dir} holds no GGUF blocks (only a .gguf model has them)")
        if torch.device(device).type != "cpu":
            raise QuantizationError("the GGUF kernels run on the CPU; on other devices the dense weights serve")
        if dtype != torch.float32:
            raise QuantizationError(f"the GGUF kernels compute in float32, not {dtype}")
        if get_tp_size() > 1:
            raise QuantizationError("the GGUF kernels serve one tensor-parallel rank (a block's row is not split)")
        reason = cpu_unsupported_reason()
        if reason is None and not _KERNEL.available():
            reason = f"the kernel could not be built: {_KERNEL.unavailable_reason()}"
        if reason is not None:
            raise QuantizationError(reason)
        from safetensors import safe_open

        with safe_open(str(self.path), framework="pt") as blocks:
            self.types: dict[str, str] = json.loads((blocks.metadata() or {}).get("types", "{}"))
        # checkpoint tensor whose blocks a layer loads -> the name the model loads them under
        self.served: dict[str, str] = {}
        self.dense_skipped: set[str] = set()

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        tied_to = getattr(layer, "tied_to", None)  # a tied head: the embedding's blocks
        parts = [tied_to] if tied_to else self.checkpoint_parts(prefix)
        kinds = {self.types.get(f"{part}.weight") for part in parts}
        if len(kinds) != 1:
            return None  # parts of different types: one blocks tensor cannot hold them
        kind = kinds.pop()
        input_size: int = getattr(layer, "input_size")  # noqa: B009 - every linear layer and head has it
        if kind not in KERNEL_TYPE or input_size % _BLOCK_WEIGHTS[str(kind)]:
            return None  # dense, a type without a kernel, or rows that are not whole blocks
        for part in parts:
            # The tied head's blocks load as "<head>.blocks"; the fused parts' as "<part>.blocks".
            self.served[f"{part}.weight"] = f"{prefix if tied_to else part}.blocks"
            if not tied_to:  # the embedding itself stays dense (lookups)
                self.dense_skipped.add(f"{part}.weight")
        return GGUFLinearMethod(str(kind))

    def skips_checkpoint_tensor(self, name: str) -> bool:
        return name in self.dense_skipped

    def extra_checkpoint_weights(self, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        with safe_open(str(self.path), framework="pt") as blocks:
            for name, target in self.served.items():
                yield target, blocks.get_tensor(name).to(device)
