"""The ``gguf`` quantizer: a GGUF file's Q4_0, Q4_1 and Q8_0 weights computed in their blocks.

The model loader keeps the file's block bytes beside the dequantized checkpoint
(``loom.model_loader.gguf_cache``), each verified to dequantize exactly to the dense tensor. This
plugin replaces the model's linear layers by :class:`GGUFLinear`, whose CPU kernel
(``csrc/gguf_linear_cpu.cpp``) dequantizes in registers with gguf-py's own float operations: the
weights multiplied are the dense model's, bit for bit, read from 0.75 (Q4) or 1.25 (Q8_0) bytes
each instead of 4. Fused projections (qkv, gate/up) concatenate their parts' rows; a tied model
also gets a quantized logits head from the embedding's blocks.

fp32 activations on an x86-64 CPU with AVX2 and FMA. On other devices, with ``--dtype`` other
than float32, or for other block types, the dense weights serve (``--quantize auto`` falls back
silently; ``--quantize gguf`` fails saying why).
"""

from __future__ import annotations

import json
from pathlib import Path

import structlog
import torch
import torch.nn.functional as F
from torch import nn

from loom.cpu_extension import CpuExtension, cpu_flags, kernels_enabled
from loom.layers.quantization import QuantizationError
from loom.model_loader.gguf_cache import BLOCKS_FILE

log = structlog.get_logger(__name__)

GGML_TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # fp16 scale [, fp16 min], 32 weights
QK = 32
# From this many rows on, a GEMM on the dequantized weight (MKL) serves instead of the kernel.
# Below it, every row's sums run in one order, whatever the batch.
DENSE_ROWS = 1024

_KERNEL = CpuExtension("loom_gguf_linear", Path(__file__).parent / "csrc" / "gguf_linear_cpu.cpp",
                       namespace="loom_gguf_cpu", op="linear", extra_cflags=["-ffp-contract=off"])


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


def repack(raw: torch.Tensor, type_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The file's blocks ``raw`` [N, K/32 * block bytes] uint8 -> the kernel's (qs, d, m).

    Output columns (rows of W) go in groups of 8, padded: qs [G, K/2, 8] uint8 holding weights
    2p and 2p+1 in the low and high nibble (Q4_0, Q4_1) or [G, K, 8] int8 (Q8_0); d and m
    [G, K/32, 8] float32 (m is empty unless Q4_1). See the .cpp file for the formulas.
    """
    bb = _BLOCK_BYTES[type_name]
    n, row_bytes = raw.shape
    nb = row_bytes // bb
    k = nb * QK
    blocks = raw.reshape(n, nb, bb)
    groups = (n + 7) // 8
    pad = groups * 8 - n

    def grouped_scales(col: int) -> torch.Tensor:  # fp16 at byte col of every block -> [G, K/32, 8]
        half = blocks[:, :, col:col + 2].contiguous().view(torch.float16).reshape(n, nb).float()
        return nn.functional.pad(half, (0, 0, 0, pad)).reshape(groups, 8, nb).transpose(1, 2).contiguous()

    d = grouped_scales(0)
    m = grouped_scales(2) if type_name == "Q4_1" else torch.empty(0, 0, 0)
    payload = blocks[:, :, (4 if type_name == "Q4_1" else 2):]
    if type_name == "Q8_0":
        q = payload.contiguous().view(torch.int8).reshape(n, k)
        qs = nn.functional.pad(q, (0, 0, 0, pad)).reshape(groups, 8, k).transpose(1, 2).contiguous()
        return qs, d, m
    # A block's weight j < 16 is the low nibble of its byte j, weight j >= 16 the high nibble of byte j - 16.
    q = torch.cat([payload & 0xF, payload >> 4], dim=2).reshape(n, k)
    q = nn.functional.pad(q, (0, 0, 0, pad)).reshape(groups, 8, k).transpose(1, 2)  # [G, K, 8]
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).contiguous()
    return qs, d, m


class GGUFLinear(nn.Module):
    """``y = x @ W^T (+ bias)`` with W kept in GGUF blocks; x fp32 on the CPU."""

    def __init__(self, raw: torch.Tensor, type_name: str, in_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        if type_name not in GGML_TYPE_IDS:
            raise QuantizationError(f"GGUF type {type_name} has no kernel (supported: {', '.join(GGML_TYPE_IDS)})")
        self.type_name, self.qtype = type_name, GGML_TYPE_IDS[type_name]
        self.out_features, self.in_features = int(raw.shape[0]), in_features
        qs, d, m = repack(raw, type_name)
        if d.shape[1] * QK != in_features:
            raise QuantizationError(f"blocks hold {d.shape[1] * QK} inputs, the layer has {in_features}")
        self.register_buffer("qs", qs)
        self.register_buffer("d", d)
        self.register_buffer("m", m)
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None

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

        fused_layout = getattr(model, "fused_layout", None)  # fused projection -> its checkpoint parts
        layout: dict[str, tuple[str, int, int]] = fused_layout() if callable(fused_layout) else {}
        replaced = 0
        with safe_open(str(self.path), framework="pt") as blocks:
            types: dict[str, str] = json.loads((blocks.metadata() or {}).get("types", "{}"))

            def build(names: list[str], in_features: int, out_features: int,
                      bias: torch.Tensor | None) -> GGUFLinear | None:
                kinds = {types.get(name) for name in names}
                if len(kinds) != 1 or None in kinds or next(iter(kinds)) not in GGML_TYPE_IDS:
                    return None  # a part is dense, of a type without a kernel, or the parts differ
                raw = torch.cat([blocks.get_tensor(name) for name in names])
                if raw.shape[0] != out_features:
                    return None
                return GGUFLinear(raw, str(next(iter(kinds))), in_features, bias)

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
                 types=sorted(set(types.values())))
        return replaced
