"""The torch backend's compiled CPU kernel: decode attention read in place from the paged pool.

Without it, CPU decode gathers every sequence's blocks into a padded contiguous batch and runs
SDPA on the copy: the context is read, written, and read again each layer. The kernel in
``csrc/paged_decode_cpu.cpp`` reads each key and value row once, where it lies, on ATen's own
thread pool. Measured on this project's 2-core VM, per layer of SmolLM2-135M: 32 sequences of
about 220 tokens 2.8 -> 1.3 ms; 64 sequences of 100..768 tokens 11.8 -> 6.1 ms.

It is compiled on first use with ``torch.utils.cpp_extension`` (about 15 s on 2 cores, needs a
C++ compiler and ninja) and cached under torch's extension directory (``TORCH_EXTENSIONS_DIR``,
default ``~/.cache/torch_extensions``); later processes load it at once. Built for the host CPU
(``-march=native``), so the cache key includes the CPU's feature flags. If it cannot be built the
backend logs why and keeps the gather + SDPA path, which gives the same results up to float
rounding. ``LOOM_CPU_KERNELS=0`` turns the kernel off.
"""

from __future__ import annotations

import hashlib
import os
import platform
import threading
from pathlib import Path

import structlog
import torch

log = structlog.get_logger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode_cpu.cpp"
_lock = threading.Lock()
_state: dict[str, bool | str] = {}  # "ok": bool, "why": the reason it is unavailable


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _extension_name() -> str:
    digest = hashlib.sha256((_cpu_flags() + torch.__version__).encode()).hexdigest()[:10]
    return f"loom_cpu_attention_{digest}"


def _build() -> None:
    from torch.utils import cpp_extension

    log.info("loading the CPU decode-attention kernel (compiled once, then cached)",
             source=str(_SOURCE))
    cpp_extension.load(name=_extension_name(), sources=[str(_SOURCE)],
                       extra_cflags=["-O3", "-march=native"], is_python_module=False, verbose=False)


def cpu_decode_kernel_available() -> bool:
    """Build or load the kernel once per process; False (and logged why) when it cannot be."""
    if os.environ.get("LOOM_CPU_KERNELS", "1") == "0":
        return False
    with _lock:
        if "ok" not in _state:
            try:
                _build()
                _state["ok"] = hasattr(torch.ops.loom_cpu, "paged_decode_attention")
            except Exception as exc:  # no compiler, no ninja, a build error: keep the torch path
                _state["ok"], _state["why"] = False, repr(exc)
                log.warning("CPU decode-attention kernel unavailable; using gather + SDPA", error=repr(exc))
        return bool(_state["ok"])


def unavailable_reason() -> str | None:
    return None if _state.get("ok") else str(_state.get("why", "not built yet, or LOOM_CPU_KERNELS=0"))


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
