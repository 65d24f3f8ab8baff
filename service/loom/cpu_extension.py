"""Compiling a plugin's C++ CPU kernels on first use, once per machine, and knowing why not.

The kernels are torch operators in one .cpp file each, built with ``torch.utils.cpp_extension``
for the host CPU (``-march=native``) and cached in torch's extension directory
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), so later processes load them
at once. The cache name includes the CPU's feature flags, the torch version and the source's path
(so checkouts side by side do not rebuild each other's).

``-fopenmp`` matters: ``at::parallel_for`` is a header template whose OpenMP pragmas are compiled
into the extension itself; without the flag a kernel silently runs on one thread. The runtime is
the one torch already loaded (the extension links none of its own).

When a kernel cannot be built (no compiler, no ninja, a CPU without the instructions) the
plugin logs why and keeps its pure-torch path. ``LOOM_CPU_KERNELS=0`` turns every kernel off.

Loading a kernel from the cache takes milliseconds; compiling one takes 10-25 s on 2 cores (each
extension quotes its own measured figure). A load still running after a second is a compile: it
is then announced with that figure and reported every few seconds until it ends
(:mod:`loom.startup_progress`), so a first start is never silent while it compiles.

Torch guards a build directory with a ``lock`` file that its builder deletes when it is done. A
process that dies inside ``cpp_extension.load`` (killed, or exiting while a daemon thread warms a
kernel: every load takes that lock, even when nothing needs compiling) leaves the file behind, and
every later load waited for it forever ("compiling a CPU kernel ... still running"). Loom's loads
therefore first take an ``flock`` on a file of their own beside it, which the kernel releases
when its holder dies: whoever holds it is the only loader, so a torch ``lock`` found then is a
dead process's, and is removed (logged).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import sysconfig
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import structlog
import torch

# Imported here, in whichever thread imports this module first (the main one), not in the
# background threads that build kernels: cpp_extension imports setuptools, which rearranges
# imports (its vendored packages, distutils hooks) and, raced against the main thread importing
# transformers, left a rank process without ``packaging`` now and then ("No module named
# 'packaging'" in the tensor-parallel tests under load).
from torch.utils import cpp_extension

from loom.startup_progress import ProgressReporter

# Likewise sysconfig's variables, filled here once: Python 3.11's ``get_config_vars()`` publishes
# its dict before filling it, so a main thread reading it while a background build fills it
# (distutils inside ``cpp_extension.load``) saw ``EXE`` as None, and ``import triton`` (whose
# knobs append ``get_config_var("EXE")`` to a tool name) failed with a TypeError
# (scripts/golden_outputs.py, 2026-12-03).
sysconfig.get_config_vars()


log = structlog.get_logger(__name__)

_COMPILE_ANNOUNCE_AFTER_S = 1.0  # a cached kernel loads in milliseconds

INCLUDE_DIR = Path(__file__).parent / "csrc"  # headers shared by the kernels (loom_vec_math.h)


def cpu_flags() -> str:
    """The host CPU's feature flags line (``/proc/cpuinfo``), or what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def kernels_enabled() -> bool:
    return os.environ.get("LOOM_CPU_KERNELS", "1") != "0"


class CpuExtension:
    """One .cpp file of torch operators in namespace ``namespace``, built on first ``available()``."""

    def __init__(self, name: str, source: Path, namespace: str, op: str, extra_cflags: Sequence[str] = (),
                 usual_build_s: float | None = None) -> None:
        """``usual_build_s``: how long compiling it took on the 2-core development machine."""
        self.name, self.source, self.namespace, self.op = name, source, namespace, op
        self.usual_build_s = usual_build_s
        self.cflags = ["-O3", "-march=native", "-fopenmp", *extra_cflags]
        self._lock = threading.Lock()
        self._ok: bool | None = None
        self._why: str | None = None

    def _module_name(self) -> str:
        # The paths too: torch keys its cache by name and rebuilds when the include paths or
        # sources differ, so two checkouts (worktrees, venvs) sharing one name rebuilt each
        # other's kernel on every start; each checkout now keeps its own.
        key = cpu_flags() + torch.__version__ + " ".join(self.cflags) + str(self.source) + str(INCLUDE_DIR)
        return f"{self.name}_{hashlib.sha256(key.encode()).hexdigest()[:10]}"

    def available(self) -> bool:
        """Build or load the extension once per process; False (and logged why) when it cannot be."""
        if not kernels_enabled():
            return False
        with self._lock:
            if self._ok is None:
                try:
                    log.debug("loading a CPU kernel", kernel=self.name, source=str(self.source))
                    with ProgressReporter("compiling a CPU kernel, once per machine",
                                          self.usual_build_s, announce_after_s=_COMPILE_ANNOUNCE_AFTER_S,
                                          kernel=self.name, source=str(self.source)):
                        name = self._module_name()
                        with _sole_loader(Path(cpp_extension._get_build_directory(name, verbose=False)), self.name):
                            cpp_extension.load(name=name, sources=[str(self.source)], extra_cflags=self.cflags,
                                               extra_include_paths=[str(INCLUDE_DIR)], is_python_module=False,
                                               verbose=False)
                    self._ok = hasattr(getattr(torch.ops, self.namespace), self.op)
                    if not self._ok:
                        self._why = f"the build did not register torch.ops.{self.namespace}.{self.op}"
                except Exception as exc:  # no compiler, no ninja, a build error: the torch path stays
                    self._ok, self._why = False, repr(exc)
                    log.warning("CPU kernel unavailable; using the torch path", source=str(self.source),
                                error=repr(exc))
            return self._ok

    def unavailable_reason(self) -> str | None:
        if self._ok:
            return None
        if not kernels_enabled():
            return "LOOM_CPU_KERNELS=0"
        return self._why or "not built yet"


@contextlib.contextmanager
def _sole_loader(build_dir: Path, kernel: str) -> Iterator[None]:
    """Hold an ``flock`` on ``build_dir/loom.flock`` (released by the kernel if this process
    dies); a torch ``lock`` file still there is a dead loader's, and is removed."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "loom.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("removing a build lock left by a process that died while loading a CPU kernel",
                            kernel=kernel, lock=str(stale))
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
