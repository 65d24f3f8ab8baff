"""The FP8 KV cache format (``--kv-cache-dtype fp8``): e4m3 codes with one scale per token and head.

A layer's pool stays one tensor, of bytes, allocated as ``[2, num_blocks, block_size, Hkv, D + 4]``
uint8 (so that whole-block operations, the block size and the head count read as for a dense
pool). Within a block the bytes are not rows of ``D + 4``: the block's ``block_size x Hkv x D``
float8_e4m3fn codes come first, then its ``block_size x Hkv`` float32 scales ``[block_size, Hkv]``.
The codes of keys are ``[block_size, Hkv, D]`` (a key's row contiguous); the codes of values are
``[Hkv, D, block_size]`` (a value element's tokens contiguous). Why the two orders differ: the
attention kernel runs ``P.V`` with the tokens as the dot's reduction dimension, and the tensor
cores want that dimension contiguous. bf16 tiles are transposed on the way by ``ldmatrix``;
nothing transposes bytes cheaply, and reading values stored token-major cost one narrow
shared-memory load a byte. Rows of key codes start 16-byte aligned (``D`` a multiple of 16), and
so do runs of 16 tokens of value codes (``block_size`` >= 16), so kernels load both with wide
vector loads; rows of ``D + 4`` bytes were only 4-byte aligned, and on the H200 that made
attention over the FP8 pool slower than over bf16 (2026-12-02). :func:`views` is the one place
that knows this layout.

A (token, KV head) row is ``x ~= codes * scale`` with ``scale = max|x| / 448`` (448: e4m3's
largest finite value). The K/V of one token cost ``D + 4`` bytes a head instead of ``2 D`` in
bf16: 1.88x the tokens at ``D = 64``, 1.94x at ``D = 128``.

Why a scale per token and head rather than per layer: it needs no calibration (a static scale must
be known before the first K/V is written and clips whatever a later prompt exceeds it by), every
row uses e4m3's whole range, and the scale sits in the block the kernels already read. Its cost is
4 bytes a row and one multiply per key (the scores by the K scales, the probabilities by the V
scales), not per element.

Everything that attends over cached keys reads them through this format, including the tokens of
the step that wrote them, so a request's output does not depend on whether its prompt was
prefilled in one chunk, several, or found in the prefix cache.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from loom.config import KV_CACHE_DTYPES

__all__ = ["KV_CACHE_DTYPES", "PoolViews", "allocate", "dequantize", "is_fp8_kv_cache_dtype", "packed_row_bytes", "quantize",
           "read_blocks", "round_trip", "views", "write"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_BYTES = 4  # one float32 a (token, head) row, after the block's codes


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


class PoolViews(NamedTuple):
    """A packed pool's codes and scales, each a view of the pool's bytes (writes land in it)."""

    k_codes: torch.Tensor  # [nb, bs, Hkv, D] float8_e4m3fn, strides (block, Hkv D, D, 1)
    v_codes: torch.Tensor  # [nb, bs, Hkv, D] float8_e4m3fn, strides (block, 1, D bs, bs): token-contiguous
    k_scales: torch.Tensor  # [nb, bs, Hkv] float32
    v_scales: torch.Tensor  # [nb, bs, Hkv] float32


def views(kv_cache: torch.Tensor) -> PoolViews:
    """The pool's key and value codes (``[nb, bs, Hkv, D]`` float8_e4m3fn each, indexed alike but
    laid out differently: see the module's docstring) and scales (``[nb, bs, Hkv]`` float32).

    Any pool whose blocks are each contiguous works (a slice or selection of blocks too)."""
    _, nb, bs, hkv, row = kv_cache.shape
    d = row - SCALE_BYTES
    s_kv, s_blk = kv_cache.stride(0), kv_cache.stride(1)
    if kv_cache.stride()[2:] != (hkv * row, row, 1) or (nb > 1 and s_blk < bs * hkv * row):
        raise ValueError("an FP8 KV pool's blocks must each be contiguous")
    if s_kv % SCALE_BYTES or s_blk % SCALE_BYTES or kv_cache.storage_offset() % SCALE_BYTES:
        raise ValueError("an FP8 KV pool must be 4-byte aligned")
    base = kv_cache.storage_offset()
    k_codes = kv_cache.as_strided((nb, bs, hkv, d), (s_blk, hkv * d, d, 1), base).view(FP8_DTYPE)
    v_codes = kv_cache.as_strided((nb, bs, hkv, d), (s_blk, 1, d * bs, bs), base + s_kv).view(FP8_DTYPE)
    # float32 over the same storage (views of a uint8 tensor as float32 need 4-aligned strides)
    words = kv_cache.view(torch.float32)  # [2, nb, bs, Hkv, row / 4]
    s_base = (base + bs * hkv * d) // SCALE_BYTES
    k_scales = words.as_strided((nb, bs, hkv), (s_blk // SCALE_BYTES, hkv, 1), s_base)
    v_scales = words.as_strided((nb, bs, hkv), (s_blk // SCALE_BYTES, hkv, 1), s_base + s_kv // SCALE_BYTES)
    return PoolViews(k_codes, v_codes, k_scales, v_scales)


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
    bs = kv_cache.shape[2]
    pool = views(kv_cache)
    blocks, offsets = slots // bs, slots % bs  # [T] each
    for x, codes_pool, scales_pool in ((k, pool.k_codes, pool.k_scales), (v, pool.v_codes, pool.v_scales)):
        codes, scales = quantize(x)  # [T, Hkv, D], [T, Hkv]
        codes_pool.view(torch.uint8).index_put_((blocks, offsets), codes.view(torch.uint8))
        scales_pool.index_put_((blocks, offsets), scales)


def read_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks ``block_ids [n]`` of a packed pool, dequantized: ``[2, n, bs, Hkv, D]`` in ``dtype``."""
    pool = views(kv_cache.index_select(1, block_ids))
    return torch.stack([dequantize(pool.k_codes, pool.k_scales, dtype), dequantize(pool.v_codes, pool.v_scales, dtype)])
