"""A grammar's token bitmask applied to float32 logits on the CPU, word by word
(``csrc/cpu_bitmask.cpp``): whole-word skips and fills where xgrammar's CPU kernel tests every
token's bit (9-17 ms for 64 rows of 49,152 logits on 2 cores). Compiled on first use
(``loom.cpu_extension``); without a compiler, or with ``LOOM_CPU_KERNELS=0``, xgrammar's kernel
or the torch path serves."""

from __future__ import annotations

from pathlib import Path

import torch

from loom.cpu_extension import CpuExtension

_OPS = CpuExtension("loom_cpu_bitmask", Path(__file__).parent / "csrc" / "cpu_bitmask.cpp",
                    namespace="loom_cpu_bitmask", op="apply_bitmask_", usual_build_s=10)


def available() -> bool:
    return _OPS.available()


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    """-inf in place where a token's bit is 0: [N, V] float32 logits, [N, ceil(V / 32)] int32
    bitmask, only the logits rows ``rows`` (int64, CPU) when given."""
    torch.ops.loom_cpu_bitmask.apply_bitmask_(logits, bitmask, rows)
