"""``jit``: Triton's ``triton.jit`` where Triton is installed. Without it the kernels stay plain
Python functions that are never launched (every caller checks its module's ``HAS_TRITON`` before
a launch), so the modules that define kernels import on a machine without Triton.

``pdl_launch(device)``: the keyword arguments that launch a kernel with Programmatic Dependent
Launch (PDL) on ``device``, or none. A kernel that takes them has a ``USE_PDL: tl.constexpr =
False`` parameter; set, it calls ``tl.extra.cuda.gdc_wait()`` before reading anything an earlier
kernel may have written and ``gdc_launch_dependents()`` after it (docs/gpu-kernels.md,
"Programmatic Dependent Launch"). Without PDL the launch passes nothing, so the kernel compiles
and runs exactly as it did before the parameter existed.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from typing import Any

from loom import kernel_switches

try:
    import triton

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

# The launch keywords with PDL: the constexpr the kernel branches on and Triton's launch option
# (``launch_pdl``: the launcher adds CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION).
_PDL_ON: Mapping[str, bool] = {"USE_PDL": True, "launch_pdl": True}
_PDL_OFF: Mapping[str, bool] = {}


def jit(fn: Callable[..., Any]) -> Any:
    """``triton.jit(fn)``, or ``fn`` itself without Triton."""
    return triton.jit(fn) if HAS_TRITON else fn


def interpreting() -> bool:
    """Whether kernels run in Triton's interpreter (``TRITON_INTERPRET`` set and not 0), which
    has no inline PTX and no grid-dependency intrinsics."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_has_pdl() -> bool:
    """Whether this Triton has the grid-dependency intrinsics and the ``launch_pdl`` option
    (3.4 and later); the interpreter (``TRITON_INTERPRET=1``) never uses them."""
    if not HAS_TRITON or interpreting():
        return False
    try:
        import dataclasses

        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra import cuda as tl_cuda
    except ImportError:
        return False
    options = {f.name for f in dataclasses.fields(CUDAOptions)}
    return "launch_pdl" in options and hasattr(tl_cuda, "gdc_wait") and hasattr(tl_cuda, "gdc_launch_dependents")


@functools.cache
def _device_has_pdl(device_type: str, index: int | None) -> bool:
    if device_type != "cuda" or not triton_has_pdl():
        return False
    import torch

    if not torch.cuda.is_available() or torch.version.hip is not None:
        return False
    major, _ = torch.cuda.get_device_capability(index if index is not None else torch.cuda.current_device())
    return major >= 9


def pdl_enabled(device: Any) -> bool:
    """Whether kernels launched on ``device`` (a ``torch.device``) use PDL: ``LOOM_PDL`` on
    (``kernel_switches.pdl``, read at each call), a CUDA device of compute capability 9 or later,
    and a Triton with the API, not interpreting."""
    return kernel_switches.pdl and _device_has_pdl(device.type, device.index)


def pdl_launch(device: Any) -> Mapping[str, bool]:
    """The keywords to add to a launch on ``device``: ``{"USE_PDL": True, "launch_pdl": True}``
    where :func:`pdl_enabled`, else none (the kernel's ``USE_PDL`` keeps its default, False).
    Splat it into the launch: ``kernel[grid](..., **pdl_launch(x.device))``."""
    return _PDL_ON if pdl_enabled(device) else _PDL_OFF


if HAS_TRITON:
    import triton.language as tl

    @jit
    def pdl_prologue() -> None:
        """A PDL-launched kernel's first statement (under ``if USE_PDL:``): wait until the
        kernels before it in the stream have completed and their writes are visible
        (``griddepcontrol.wait``; everything before it may overlap their tail), then let the next
        PDL kernel be scheduled (``griddepcontrol.launch_dependents``: it fires once every program
        of this grid has issued it or exited). Signalling this early is safe because the next
        kernel's own wait is for this grid's completion and memory flush, not for the signal; it
        only lets the next kernel's programs be placed and run up to that wait while this one
        works, and it cannot take SM slots from this grid's programs, which have all started by
        the time the signal fires."""
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
else:

    def pdl_prologue() -> None:
        """Never called without Triton (kernels are not launched)."""
