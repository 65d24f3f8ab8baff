"""Run Triton kernels on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``).

Must be imported before the kernel modules: ``triton.jit`` decides at decoration time whether a
function is compiled or interpreted. Also works around the interpreter of triton 3.6 turning a
scalar into a one-element 1-d array, which numpy >= 2.4 refuses to convert with ``int()`` (so a
``range`` over loaded bounds fails).
"""

from __future__ import annotations

import os
from typing import Any


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
    return True
