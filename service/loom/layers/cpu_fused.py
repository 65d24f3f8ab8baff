"""The CPU counterparts of ``fused_ops``: RMSNorm (with its residual add), RoPE and SiLU-and-mul
as one C++ operator each (``csrc/cpu_fused_ops.cpp``), for float32 on the CPU.

A batch-1 decode step of SmolLM2 on two cores dispatched about 27 torch ops a layer, most of
them the norm's and RoPE's small elementwise ops; each costs a few microseconds of dispatch
whatever its size. The operators reproduce the torch path's roundings except the order of the
norm's sum of squares and SiLU's exp (an ulp or so). Compiled on first use (``loom.cpu_extension``); without a compiler, or
with ``LOOM_FUSED_KERNELS=0`` or ``LOOM_CPU_KERNELS=0``, the torch path runs.
"""

from __future__ import annotations

from pathlib import Path

import torch

from loom import kernel_switches
from loom.cpu_extension import CpuExtension

_OPS = CpuExtension("loom_cpu_fused_ops", Path(__file__).parent / "csrc" / "cpu_fused_ops.cpp",
                    namespace="loom_cpu_fused", op="rotary", extra_cflags=["-ffp-contract=off"],
                    usual_build_s=13)  # 12.6-12.9 s measured on 2 cores
_built = False  # True once available: later calls skip the extension's lock


def available() -> bool:
    global _built
    if not kernel_switches.fused_kernels:
        return False
    if not _built:
        _built = _OPS.available()
    return _built


def unavailable_reason() -> str | None:
    return _OPS.unavailable_reason()


def norm_supported(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.dim() == 2 and x.stride(-1) == 1
            and (residual is None or (residual.dtype == torch.float32 and residual.stride(-1) == 1))
            and available())


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + x`` (``h = x`` without a residual), then ``(RMSNorm(h), h)``; [T, H]."""
    out, h = torch.ops.loom_cpu_fused.add_rms_norm(x, residual, weight, eps)
    return out, h


def rotary_supported(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> bool:
    return (q.device.type == "cpu" and q.dtype == torch.float32 and k.dtype == torch.float32
            and positions.dtype == torch.int64 and available())


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` at ``positions [T]`` from the [P, D/2] tables."""
    q_out, k_out = torch.ops.loom_cpu_fused.rotary(positions.contiguous(), q, k, cos, sin)
    return q_out, k_out


def silu_and_mul_supported(x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.stride(-1) == 1
            and x.shape[-1] % 2 == 0 and available())


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x = [gate | up]`` [T, 2I] -> [T, I]."""
    out: torch.Tensor = torch.ops.loom_cpu_fused.silu_and_mul(x)
    return out
