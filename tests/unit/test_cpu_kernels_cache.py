"""CPU kernel cache names (loom.cpu_extension): one per checkout, so two checkouts sharing torch's
extension directory do not rebuild each other's kernels at every start."""

from __future__ import annotations

from pathlib import Path

from loom.cpu_extension import CpuExtension


def test_cache_name_depends_on_the_source_path_not_only_the_kernel() -> None:
    a = CpuExtension("loom_k", Path("/a/plugins/k.cpp"), "loom", "op")
    b = CpuExtension("loom_k", Path("/b/plugins/k.cpp"), "loom", "op")
    assert a._module_name() != b._module_name()
    assert a._module_name() == CpuExtension("loom_k", Path("/a/plugins/k.cpp"), "loom", "op")._module_name()
    assert a._module_name().startswith("loom_k_")
