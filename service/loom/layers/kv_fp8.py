"""The FP8 KV cache format (``--kv-cache-dtype fp8``): e4m3 codes with one scale per token and head.

A layer's pool stays one tensor, of bytes: ``[2, num_blocks, block_size, Hkv, D + 4]`` uint8. Each
(token, KV head) row holds its ``D`` float8_e4m3fn codes followed by its float32 scale, so a row
is ``x ~= codes * scale`` with ``scale = max|x| / 448`` (448: e4m3's largest finite value). The
K/V of one token cost ``D + 4`` bytes a head instead of ``2 D`` in bf16: 1.88x the tokens at
``D = 64``, 1.94x at ``D = 128``.

Why a scale per token and head rather than per layer: it needs no calibration (a static scale must
be known before the first K/V is written and clips whatever a later prompt exceeds it by), every
row uses e4m3's whole range, and the scale rides in the row the kernels already read. Its cost is
4 bytes a row and one multiply per key (the scores by the K scales, the probabilities by the V
scales), not per element.

Everything that attends over cached keys reads them through this format, including the tokens of
the step that wrote them, so a request's output does not depend on whether its prompt was
prefilled in one chunk, several, or found in the prefix cache.
"""

from __future__ import annotations

import torch

from loom.config import KV_CACHE_DTYPES

__all__ = ["KV_CACHE_DTYPES", "allocate", "dequantize", "is_fp8_kv_cache_dtype", "packed_row_bytes", "quantize",
           "read_blocks", "round_trip", "views", "write"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_BYTES = 4  # one float32 after each row's codes


def is_fp8_kv_cache_dtype(name: str) -> bool:
    return name in ("fp8", "fp8_e4m3")


def packed_row_bytes(head_dim: int) -> int:
    """Bytes of one (token, KV head) row: the codes, then the scale (kept 4-byte aligned)."""
    if head_dim % SCALE_BYTES:
        raise ValueError(f"an FP8 KV cache needs a head_dim divisible by {SCALE_BYTES}, got {head_dim}")
    return head_dim + SCALE_BYTES


def allocate(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
             device: torch.device) -> torch.Tensor:
    """One layer's pool, ``[2, num_blocks, block_size, Hkv, D + 4]`` uint8, zeroed (codes 0, scale 0)."""
    return torch.zeros((2, num_blocks, block_size, num_kv_heads, packed_row_bytes(head_dim)),
                       dtype=torch.uint8, device=device)


def is_packed(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == torch.uint8


def views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool as codes ``[2, nb, bs, Hkv, D]`` float8_e4m3fn and scales ``[2, nb, bs, Hkv]``
    float32, both views of the same bytes (writes through them land in the pool)."""
    d = kv_cache.shape[-1] - SCALE_BYTES
    codes = kv_cache[..., :d].view(FP8_DTYPE)
    scales = kv_cache[..., d:].view(torch.float32)[..., 0]
    return codes, scales


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x [..., D]`` -> codes ``[..., D]`` e4m3 and scales ``[...]`` float32.

    Computed in float32; the largest magnitude of a row maps to exactly 448. An all-zero row
    gets scale 0 and codes 0 (it dequantizes to zeros)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)  # [...]
    # Both divisions tensor by tensor, so correctly rounded on every device, as the Triton write
    # kernel's div_rn: CUDA divides by a Python scalar as a multiply by its reciprocal, and
    # ``448 / t`` is ``t.reciprocal() * 448``, each a bit off in some rows.
    max_t = torch.full_like(amax, FP8_MAX)
    scale = amax / max_t
    inv = torch.where(amax > 0, max_t / torch.where(amax > 0, amax, 1.0), torch.zeros_like(amax))
    # clamp: amax * (448 / amax) can round to just above 448, which e4m3 would turn into NaN
    codes = (xf * inv.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes [..., D]`` and ``scales [...]`` -> values ``[..., D]`` in ``dtype`` (computed in float32)."""
    return (codes.float() * scales.unsqueeze(-1)).to(dtype)


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """What the cache returns for ``x``: quantized and dequantized, in ``x``'s dtype."""
    codes, scales = quantize(x)
    return dequantize(codes, scales, x.dtype)


def write(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Quantize new ``k``/``v`` ``[T, Hkv, D]`` and write them at flat ``slots`` of a packed pool."""
    _, num_blocks, bs, hkv, row = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * bs, hkv, row)
    for i, x in enumerate((k, v)):
        codes, scales = quantize(x)  # [T, Hkv, D], [T, Hkv]
        packed = torch.cat([codes.view(torch.uint8), scales.unsqueeze(-1).contiguous().view(torch.uint8)], dim=-1)
        flat[i].index_copy_(0, slots, packed)


def read_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks ``block_ids [n]`` of a packed pool, dequantized: ``[2, n, bs, Hkv, D]`` in ``dtype``."""
    codes, scales = views(kv_cache.index_select(1, block_ids))
    return dequantize(codes, scales, dtype)
