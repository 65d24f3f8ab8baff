"""The ``gguf`` quantizer: a GGUF file's Q4_0, Q4_1, Q4_K and Q8_0 weights computed in their blocks.

The model loader keeps the file's block bytes beside the dequantized checkpoint
(``loom.model_loader.gguf_cache``), each verified to dequantize exactly to the dense tensor. This
plugin replaces the model's linear layers by :class:`GGUFLinear`, whose CPU kernel
(``csrc/gguf_linear_cpu.cpp``) dequantizes in registers with gguf-py's own float operations: the
weights multiplied are the dense model's, bit for bit, read from 0.625-0.75 (4-bit) or 1.125
(Q8_0) bytes each instead of 4. Fused projections (qkv, gate/up) concatenate their parts' rows; a tied model
also gets a quantized logits head from the embedding's blocks.

fp32 activations on an x86-64 CPU with AVX2 and FMA. On other devices, with ``--dtype`` other
than float32, or for other block types (Q6_K, Q5_K, ...: a fused layer with such a part too), the
dense weights serve (``--quantize auto`` falls back
silently; ``--quantize gguf`` fails saying why).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
import torch.nn.functional as F
from torch import nn

from loom.cpu_extension import CpuExtension, cpu_flags, kernels_enabled
from loom.layers.quantization import QuantizationError
from loom.model_loader.gguf_cache import BLOCKS_FILE

log = structlog.get_logger(__name__)

# The file's block types the kernel computes, and the kernel format each is served in: Q4_0 and
# Q8_0 as they are; Q4_1 and Q4_K both as w = d * q + m over blocks of 32 4-bit values (Q4_K's
# per-32 scale d * sc and minimum -(dmin * m) computed here in float32 as gguf-py computes them,
# and x - y is x + (-y) exactly: the same weights).
KERNEL_TYPE = {"Q4_0": 2, "Q4_1": 3, "Q4_K": 3, "Q8_0": 8}
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144}  # Q4_K: 256 weights a block
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


class GGUFLinear(nn.Module):
    """``y = x @ W^T (+ bias)`` with W kept in GGUF blocks; x fp32 on the CPU."""

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
        lead = x.shape[:-1]
        # [M, in]; a model's activations are already 2-D and contiguous: no reshape op then
        x2 = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, self.in_features).contiguous()
        if x2.shape[0] >= DENSE_ROWS:
            # Prefill-sized: the weights are read once per many rows, so bytes no longer matter
            # and MKL's GEMM beats the kernel there (by up to 1.2x at 4096 rows on 2 cores).
            # Dequantizing costs one pass over the weight, about 0.1% of the GEMM.
            return F.linear(x2, self.dequantized_weight(), self.bias).view(*lead, self.out_features)
        y: torch.Tensor = torch.ops.loom_gguf_cpu.linear(x2, self.qs, self.d, self.m, self.qtype, self.out_features)
        if self.bias is not None:
            y.add_(self.bias)
        return y if x2 is x else y.view(*lead, self.out_features)

    def dequantized_weight(self) -> torch.Tensor:  # [out, in] float32: the dense weight, exactly
        w: torch.Tensor = torch.ops.loom_gguf_cpu.dequantize(self.qs, self.d, self.m, self.qtype, self.out_features)
        return w

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, type={self.type_name}, " \
               f"bias={self.bias is not None}"


def _parts_of(module_name: str, layout: dict[str, tuple[str, int, int]]) -> list[str]:
    """The checkpoint tensors whose rows make up a module's weight, in row order."""
    prefix, _, leaf = module_name.rpartition(".")
    parts = sorted((offset, hf) for hf, (fused, offset, _) in layout.items() if fused == leaf)
    names = [hf for _, hf in parts] or [leaf]
    return [f"{prefix}.{name}.weight" if prefix else f"{name}.weight" for name in names]


class GGUFQuantizer:
    """Swaps a model's linear layers for GGUFLinear where the file's blocks allow it."""

    @classmethod
    def for_checkpoint(cls, model_dir: Path) -> bool:
        return (Path(model_dir) / BLOCKS_FILE).is_file()

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> None:
        self.path = Path(model_dir) / BLOCKS_FILE
        if not self.path.is_file():
            raise QuantizationError(f"{model_dir} holds no GGUF blocks (only a .gguf model has them)")
        if torch.device(device).type != "cpu":
            raise QuantizationError("the GGUF kernels run on the CPU; on other devices the dense weights serve")
        if dtype != torch.float32:
            raise QuantizationError(f"the GGUF kernels compute in float32, not {dtype}")
        reason = cpu_unsupported_reason()
        if reason is None and not _KERNEL.available():
            reason = f"the kernel could not be built: {_KERNEL.unavailable_reason()}"
        if reason is not None:
            raise QuantizationError(reason)

    def quantize(self, model: nn.Module) -> int:
        from safetensors import safe_open

        started = time.monotonic()
        fused_layout = getattr(model, "fused_layout", None)  # fused projection -> its checkpoint parts
        layout: dict[str, tuple[str, int, int]] = fused_layout() if callable(fused_layout) else {}
        replaced = 0
        with safe_open(str(self.path), framework="pt") as blocks:
            types: dict[str, str] = json.loads((blocks.metadata() or {}).get("types", "{}"))

            def build(names: list[str], in_features: int, out_features: int,
                      bias: torch.Tensor | None) -> GGUFLinear | None:
                kinds = [types.get(name) for name in names]
                if any(kind not in KERNEL_TYPE for kind in kinds):
                    return None  # a part is dense, or of a type without a kernel
                parts = [unpack(blocks.get_tensor(name), str(kind)) for name, kind in zip(names, kinds, strict=True)]
                if len({p.qtype for p in parts}) != 1 or sum(p.q.shape[0] for p in parts) != out_features:
                    return None
                return GGUFLinear(parts, in_features, bias, "+".join(sorted({str(k) for k in kinds})))

            for name, module in list(model.named_modules()):
                if not isinstance(module, nn.Linear):
                    continue
                new = build(_parts_of(name, layout), module.in_features, module.out_features, module.bias)
                if new is not None:
                    parent_name, _, leaf = name.rpartition(".")
                    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, new)
                    replaced += 1
            embed = getattr(getattr(model, "model", None), "embed_tokens", None)
            if getattr(model, "lm_head", True) is None and isinstance(embed, nn.Embedding):
                head = build(["model.embed_tokens.weight"], embed.embedding_dim, embed.num_embeddings, None)
                if head is not None:  # the tied head reads the embedding's blocks; lookups stay dense
                    model.lm_head = head
                    replaced += 1
        log.info("GGUF blocks serve the linear layers", layers=replaced,
                 types=sorted(set(types.values())), duration_s=round(time.monotonic() - started, 1))
        return replaced
