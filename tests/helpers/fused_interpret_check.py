"""The fused layer kernels (``loom.layers.fused_ops``) on the CPU, through Triton's interpreter.

Run as a script in its own process (``TRITON_INTERPRET`` must be set before the kernels are
defined, and must not leak into a process that compiles them for a GPU), with the group of
checks to run: ``norm``, ``combine_norm``, ``head_norm``, ``rotary``, ``qk_norm_rotary``, ``silu``,
``quantized_input`` or ``model``. Prints one line per
case and exits non-zero on a mismatch. ``tests/unit/test_fused_layers.py`` runs it; so can a
developer: ``python tests/helpers/fused_interpret_check.py rotary``. The checks and their
tolerances are in ``helpers/fused_cases.py``.
"""

from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _setup() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import triton_interpret

    triton_interpret.setup_script()


def _model_cases() -> list[tuple[str, Callable[[], None]]]:
    import loom_plugins.models
    from helpers import fused_cases
    from helpers.tiny_models import save_tiny_model

    # The layers pick the fused path for CUDA tensors only; here the CPU tensors must take it
    # (the kernels run in the interpreter). LOOM_FUSED_KERNELS=0 still selects the torch path.
    from loom import kernel_switches
    from loom.layers import fused_ops
    from loom.plugin_api import PluginRegistry

    fused_ops.enabled = lambda x: kernel_switches.fused_kernels
    registry = PluginRegistry()
    registry.register(loom_plugins.models, "loom-models", "loom-server")
    tmp = Path(tempfile.mkdtemp(prefix="loom-fused-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    return [(f"model {name}", lambda name=name: fused_cases.check_model(
        "cpu", save_tiny_model(name, tmp / name), registry)) for name in ("llama", "qwen3")]


def cases(group: str) -> list[tuple[str, Callable[[], None]]]:
    from helpers import fused_cases as fc

    def named(check: Callable[..., None], params: list[Any]) -> list[tuple[str, Callable[[], None]]]:
        return [(f"{check.__name__}{p}", lambda p=p: check("cpu", *p)) for p in params]

    if group == "norm":
        return named(fc.check_norm, fc.norm_cases(full=False))
    if group == "combine_norm":
        return named(fc.check_combine_norm, fc.combine_norm_cases())
    if group == "head_norm":
        return named(fc.check_head_norm, fc.head_norm_cases())
    if group == "rotary":
        return named(fc.check_rotary, fc.rotary_cases(full=False))
    if group == "qk_norm_rotary":
        return named(fc.check_qk_norm_rotary, fc.qk_norm_rotary_cases(full=False))
    if group == "silu":
        return named(fc.check_silu_and_mul, fc.silu_cases())
    if group == "quantized_input":
        return named(fc.check_quantized_input, fc.quantized_input_cases(full=False))
    if group == "model":
        return _model_cases()
    raise SystemExit(f"unknown group {group!r}")


def main(group: str) -> int:
    _setup()
    failures = 0
    for name, run in cases(group):
        try:
            run()
            print(f"ok   {name}")
        except AssertionError as exc:
            failures += 1
            print(f"FAIL {name}: {exc}")
        except Exception:
            failures += 1
            print(f"FAIL {name}: {traceback.format_exc()}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else "norm"))
