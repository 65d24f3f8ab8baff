"""The paged backend's RoPE-and-store launch (``rope_store`` in ``plugins/attention/triton_kernels.py``)
on the CPU, through Triton's interpreter, against the two launches it replaces.

Run as a script in its own process (``TRITON_INTERPRET`` must be set before the kernels are
defined); ``tests/unit/test_rope_store.py`` runs it. Exits non-zero on a mismatch.

Checked, for Llama's plain RoPE, Qwen3's per-head RMSNorm then RoPE and Gemma 3's ``(1 + w)`` norm,
in float32, fp16 and bf16 (no dots here, so the interpreter's bf16 is exact with the patched
rounding), into a bf16 / fp16 / float32 pool and the packed FP8 pool: the rotated q equals
``fused_ops.rotary`` / ``qk_norm_rotary``'s bits, and the whole pool after the launch equals the
pool after ``store_kv`` of that launch's rotated K and V, byte for byte, with padding slots
(``-1``) left untouched, K / V given as strided views of one qkv row, and a head of 24 (its halves
not a power of two).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _setup() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import triton_interpret

    triton_interpret.setup_script()


# (T, Hq, Hkv, D, activation dtype, norm: None / "rms" / "gemma", FP8 pool, page)
CASES = [
    (5, 4, 2, 32, "float32", None, False, 4),
    (3, 8, 2, 64, "bfloat16", None, False, 16),  # Llama
    (4, 4, 2, 32, "bfloat16", "rms", False, 4),  # Qwen3
    (4, 4, 1, 24, "float16", "rms", False, 4),  # halves of 12
    (3, 4, 2, 32, "bfloat16", "gemma", False, 8),  # Gemma 3
    (6, 4, 2, 32, "bfloat16", None, True, 4),  # FP8 pool
    (4, 4, 2, 64, "bfloat16", "rms", True, 16),  # Qwen3 with an FP8 pool
]


def run_case(T: int, hq: int, hkv: int, d: int, dtype_name: str, norm: str | None, fp8: bool,
             page: int) -> list[str]:
    import torch

    from loom.layers import fused_ops, kv_fp8
    from loom.layers.rotary import RopeArgs, RotaryEmbedding, _default_inv_freq
    from loom_plugins.attention.triton_kernels import rope_store, store_kv

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(T * 131 + d)
    qkv = (torch.randn(T, (hq + 2 * hkv) * d, generator=gen) * 2).to(dtype)
    q = qkv[:, : hq * d].view(T, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(T, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(T, hkv, d)
    rope = RotaryEmbedding(d, 256, _default_inv_freq(10000.0, d))
    positions = torch.randint(0, 256, (T,), generator=gen)
    blocks = 2 * T // page + 2
    slots = torch.randperm(blocks * page, generator=gen)[:T]
    slots[1] = -1  # a CUDA-graph padding row: not written
    if norm is None:
        args = RopeArgs(positions, rope.cos_cached, rope.sin_cached)
        want_q, want_k = fused_ops.rotary(positions, q, k, rope.cos_cached, rope.sin_cached)
    else:
        gemma = norm == "gemma"
        wdt = torch.float32 if gemma else dtype
        qw = (1 + 0.3 * torch.randn(d, generator=gen)).to(wdt)
        kw = (1 + 0.3 * torch.randn(d, generator=gen)).to(wdt)
        args = RopeArgs(positions, rope.cos_cached, rope.sin_cached, qw, kw, 1e-6, 1e-5, gemma)
        want_q, want_k = fused_ops.qk_norm_rotary(positions, q, k, qw, kw, 1e-6, 1e-5, rope.cos_cached,
                                                  rope.sin_cached, gemma)
    if fp8:
        pool = kv_fp8.allocate(blocks, page, hkv, d, torch.device("cpu"))
        pool.copy_(torch.randint(0, 256, pool.shape, generator=gen, dtype=torch.uint8))  # stale rows stay
    else:
        pool = torch.randn(2, blocks, page, hkv, d, generator=gen).to(dtype)
    want_pool = pool.clone()
    store_kv(want_k, v, want_pool, slots)
    got_q = rope_store(q, k, v, pool, slots, args)
    errors = []
    if not torch.equal(got_q, want_q):
        errors.append(f"q differs by up to {(got_q.float() - want_q.float()).abs().max().item()}")
    if not torch.equal(pool.view(torch.uint8) if pool.dtype != torch.uint8 else pool,
                       want_pool.view(torch.uint8) if want_pool.dtype != torch.uint8 else want_pool):
        errors.append("the pool differs from store_kv's")
    return errors


def main() -> None:
    _setup()
    failed = []
    for case in CASES:
        errors = run_case(*case)
        print(f"{'FAIL' if errors else 'ok  '} rope_store T={case[0]} Hq={case[1]} Hkv={case[2]} D={case[3]} "
              f"{case[4]} norm={case[5]} fp8={case[6]} page={case[7]}{': ' + '; '.join(errors) if errors else ''}")
        failed += errors
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
