"""The torch backend's compiled CPU kernel: decode attention read in place from the paged pool.

Without it, CPU decode gathers every sequence's blocks into a padded contiguous batch and runs
SDPA on the copy: the context is read, written, and read again each layer. The kernel in
``csrc/paged_decode_cpu.cpp`` reads each key and value row once, where it lies, on ATen's own
thread pool. Against gather + SDPA on this project's 2-core VM, per layer of SmolLM2-135M
(``scripts/bench_cpu_kernels.py``): 1 sequence of 140 tokens 3.8x, 32 of 200 5.4x, 64 of 400 12x.

It is compiled on first use (about 15 s on 2 cores, needs a C++ compiler and ninja) and cached;
see ``loom.cpu_extension``. If it cannot be built the backend logs why and keeps the gather +
SDPA path, which gives the same results up to float rounding. ``LOOM_CPU_KERNELS=0`` turns the
kernel off.
"""

from __future__ import annotations

from pathlib import Path

import torch

from loom.cpu_extension import CpuExtension

_KERNEL = CpuExtension("loom_cpu_attention", Path(__file__).parent / "csrc" / "paged_decode_cpu.cpp",
                       namespace="loom_cpu", op="paged_decode_attention",
                       usual_build_s=15)  # 11.3-27.4 s measured on 2 cores (busy or not)


def cpu_decode_kernel_available() -> bool:
    """Build or load the kernel once per process; False (and logged why) when it cannot be."""
    return _KERNEL.available()


def unavailable_reason() -> str | None:
    return _KERNEL.unavailable_reason()


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D] float32, contiguous
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D] float32
    block_tables: torch.Tensor,  # [B, W] int32, contiguous
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:  # [B, Hq, D]
    """Each sequence's single query token attends to its ``seq_lens[b]`` keys in the pool (the
    last ``sliding_window`` of them when set). Call :func:`cpu_decode_kernel_available` first."""
    out: torch.Tensor = torch.ops.loom_cpu.paged_decode_attention(
        q, kv_cache, block_tables, seq_lens, scale, sliding_window or 0)
    return out


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """``loom.layers.attention.write_kv`` in one operator: k, v [T, Hkv, D] float32 into the pool
    [2, num_blocks, block_size, Hkv, D] at flat ``slots`` [T] int64."""
    torch.ops.loom_cpu.write_kv(k, v, kv_cache, slots)
