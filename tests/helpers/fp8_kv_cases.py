"""FP8 KV cache steps for backend tests: the packed pool of ``loom.layers.kv_fp8`` built from a
dense :func:`helpers.paged_cases.make_step`, and the reference such a backend must match.

The reference is the float32 test backend over what the FP8 pool holds: the cached context
dequantized, the step's new K/V quantized and dequantized (a backend attends over the values it
wrote, never the exact inputs). A backend then differs from it by float rounding only, which
keeps these checks tight where a comparison with unquantized attention could not be.
"""

from __future__ import annotations

import torch

from helpers.paged_cases import PagedStep
from helpers.reference_attention import ReferenceAttentionBackend
from loom.layers import kv_fp8


def pack(dense: torch.Tensor) -> torch.Tensor:
    """A dense pool ``[2, nb, bs, Hkv, D]`` as the packed FP8 pool ``[2, nb, bs, Hkv, D + 4]`` uint8."""
    _, nb, bs, hkv, d = dense.shape
    packed = kv_fp8.allocate(nb, bs, hkv, d, dense.device)
    pool = kv_fp8.views(packed)
    c, s = kv_fp8.quantize(dense)
    pool.k_codes.copy_(c[0])
    pool.v_codes.copy_(c[1])
    pool.k_scales.copy_(s[0])
    pool.v_scales.copy_(s[1])
    return packed


def unpack(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    pool = kv_fp8.views(packed)
    return torch.stack([kv_fp8.dequantize(pool.k_codes, pool.k_scales, dtype),
                        kv_fp8.dequantize(pool.v_codes, pool.v_scales, dtype)])


def reference(step: PagedStep, scale: float, window: int | None,
              logits_soft_cap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [T, Hq, D], the packed pool after the step's write) a backend must produce."""
    hq, hkv, d = step.q.shape[1], step.k.shape[1], step.q.shape[2]
    packed = pack(step.kv_cache.float())
    expected_pool = packed.clone()
    kv_fp8.write(step.k, step.v, expected_pool, step.meta.slot_mapping)
    dense = unpack(packed)
    backend = ReferenceAttentionBackend(hq, hkv, d, torch.float32, step.q.device)
    out = backend.forward(step.q.float(), kv_fp8.round_trip(step.k.float()), kv_fp8.round_trip(step.v.float()),
                          dense, step.meta, None, scale, window, logits_soft_cap)
    return out, expected_pool
