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


_LOAD_AFTER_A_DEAD_LOADER = """
import sys
from pathlib import Path
from torch.utils import cpp_extension
from loom.sample import cpu_bitmask
ext = cpu_bitmask._OPS
build = Path(cpp_extension._get_build_directory(ext._module_name(), verbose=False))
build.mkdir(parents=True, exist_ok=True)
(build / "lock").touch()  # what a loader killed inside cpp_extension.load leaves behind
print("available", ext.available(), "lock left", (build / "lock").exists())
"""


def test_a_build_lock_left_by_a_dead_loader_does_not_hang_the_next_load() -> None:
    """Torch's ``lock`` file outlives a process killed while it loads a kernel (every load takes
    it); the next load used to wait for it forever. Loom's loader holds an ``flock`` (released by
    the OS when its holder dies), so a torch lock found under it is stale and removed."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _LOAD_AFTER_A_DEAD_LOADER], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "available True lock left False" in proc.stdout, proc.stdout + proc.stderr
    assert "removing a build lock" in proc.stdout + proc.stderr


def test_the_loader_lock_is_released_when_its_holder_dies(tmp_path: Path) -> None:
    import fcntl
    import subprocess
    import sys

    from loom.cpu_extension import _sole_loader

    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\nfrom pathlib import Path\nfrom loom.cpu_extension import _sole_loader\n"
        f"with _sole_loader(Path({str(tmp_path)!r}), 'k'):\n    print('held', flush=True)\n    time.sleep(60)\n")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with open(tmp_path / "loom.flock", "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                raise AssertionError("a second loader got the lock while the first held it")
            except BlockingIOError:
                pass
        holder.kill()
        holder.wait(timeout=30)
        (tmp_path / "lock").touch()
        with _sole_loader(tmp_path, "k"):  # does not wait: the dead holder's lock is gone
            assert not (tmp_path / "lock").exists()
    finally:
        holder.kill()
