"""Run Triton kernels on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``).

Must be imported before the kernel modules: ``triton.jit`` decides at decoration time whether a
function is compiled or interpreted. Also works around the interpreter of triton 3.6 turning a
scalar into a one-element 1-d array, which numpy >= 2.4 refuses to convert with ``int()`` (so a
``range`` over loaded bounds fails).

Two more differences from a GPU are patched so that kernels can be checked bit for bit:

* the interpreter casts float32 to bfloat16 by truncating (and its "rtne" mode rounds ties away
  from zero and can lose the carry into the exponent), where GPUs and torch round to nearest
  even; the patched cast rounds to nearest even;
* it does not implement ``triton.language.extra.libdevice``: its ``exp`` (the accurate expf of
  CUDA) stands for ``tl.exp``, which the interpreter computes with numpy in float32;
* its float32 <-> float8_e4m3fn casts mishandle subnormals (0.4946 becomes 0.25); the patched
  casts, and float8_e4m3fn -> float16, go through torch's (round to nearest even, as the GPU's
  ``cvt.rn.satfinite``; e4m3 -> fp16 is exact).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np


def setup_script() -> None:
    """For the checker scripts run in their own process: the interpreter on, and ``loom`` /
    ``loom_plugins`` importable from the source tree when they are not installed."""
    if not enable():
        raise SystemExit("triton is not installed")
    from helpers.source_tree import make_importable

    make_importable()


def enable() -> bool:
    """Switch on the interpreter; False when triton is not installed."""
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.runtime.interpreter as interp
    except ImportError:
        return False
    original = getattr(interp, "_patch_lang_tensor", None)
    if original is not None and not getattr(original, "_loom_patched", False):

        def patched(tensor: Any, scope: Any) -> None:
            original(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        patched._loom_patched = True  # type: ignore[attr-defined]
        interp._patch_lang_tensor = patched
    _patch_bf16_rounding(interp)
    _patch_libdevice()
    return True


def row_invariant_dots() -> None:
    """Make the interpreter's ``tl.dot`` compute each output row on its own (a vector-matrix
    product per row). numpy's matmul blocks its rows, so a row's sums depend on where it sits in
    the tile (seen: 5e-6 apart); a GPU's tensor-core instructions compute every row of a tile
    alike. For checks that a kernel gives a row the same bits wherever its tile starts (a draft's
    catch-up laid out at a graph width: ``paged_padding_interpret_check.py``). Call after
    :func:`enable`."""
    import triton.runtime.interpreter as interp

    builder = interp.InterpreterBuilder
    original = builder.create_dot
    if getattr(original, "_loom_rows", False):
        return

    def create_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        out = original(self, a, b, d, input_precision, max_num_imprecise_acc)  # shapes, dtypes, fp8 handling
        a_data, b_data = a.data, b.data
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return out  # (not needed by the checks that use this)
        rows = [np.matmul(a_data[..., i, :], b_data, dtype=d.data.dtype) for i in range(a_data.shape[-2])]
        out.data = np.stack(rows, axis=-2) + d.data
        return out

    create_dot._loom_rows = True  # type: ignore[attr-defined]
    builder.create_dot = create_dot


def _patch_bf16_rounding(interp: Any) -> None:
    import triton.language as tl

    original = interp._convert_float
    if getattr(original, "_loom_patched", False):
        return

    def convert(data: Any, src: Any, dst: Any, rounding_mode: Any) -> Any:
        if src == tl.float32 and dst == tl.float8e4nv:
            return _to_e4m3(np.asarray(data, dtype=np.float32))
        if src == tl.float8e4nv and dst == tl.float32:
            return _from_e4m3(np.asarray(data, dtype=np.uint8))
        if src == tl.float8e4nv and dst == tl.float16:
            return _from_e4m3_to_f16(np.asarray(data, dtype=np.uint8))
        if src != tl.float32 or dst != tl.bfloat16:
            return original(data, src, dst, rounding_mode)
        values = np.asarray(data, dtype=np.float32)
        bits = values.view(np.uint32).astype(np.uint64)
        # Round to nearest even on the 16 dropped bits; a carry moves into the exponent.
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return np.where(np.isnan(values), np.uint16(0x7FC0), rounded).reshape(values.shape)

    convert._loom_patched = True  # type: ignore[attr-defined]
    interp._convert_float = convert


def _to_e4m3(values: Any) -> Any:
    import torch

    return torch.from_numpy(values.copy()).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def _from_e4m3(codes: Any) -> Any:
    import torch

    return torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn).float().numpy().view(np.uint32)


def _from_e4m3_to_f16(codes: Any) -> Any:
    import torch

    return torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn).half().numpy().view(np.uint16)


def _patch_libdevice() -> None:
    import triton.language as tl
    from triton.language.extra import libdevice

    # Looked up at call time: inside a kernel, tl.exp is the interpreter's patched builtin.
    libdevice.exp = lambda x: tl.exp(x)


def run_interpreted(*argv: str, extra_env: dict[str, str] | None = None, timeout: float = 600) -> str:
    """``python *argv`` in a process of its own with Triton's interpreter on (``TRITON_INTERPRET=1``
    must be set before ``triton.jit`` decorates anything, hence the process), plus ``extra_env``;
    its standard output. A non-zero exit fails the calling test with the process's output."""
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1", **(extra_env or {})}
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout
