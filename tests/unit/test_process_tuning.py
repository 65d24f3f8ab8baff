"""Process tuning, each in a child process (freezing the test process would change every later
test's collections): start-up objects frozen out of the collector's reach; freed memory kept."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import gc
from loom.process_tuning import freeze_startup_objects

keep = [[i] for i in range(10000)]  # long-lived, tracked objects of a started process
n = freeze_startup_objects()
assert n == gc.get_freeze_count() and n > 10000, n
assert not any(o is keep for o in gc.get_objects()), "a frozen object is still scanned"
young = [[i] for i in range(10)]
assert any(o is young for o in gc.get_objects()), "new objects are collected as usual"
print("ok")
"""


def test_freeze_startup_objects_exempts_what_lives_now() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


SCOPED_SCRIPT = """
import gc
from loom.process_tuning import startup_objects_frozen

class Engine:  # an in-process engine of a benchmark: in a cycle, dropped after its run
    def __init__(self):
        self.me = self

engine = Engine()
with startup_objects_frozen() as n:
    assert n > 0 and gc.get_freeze_count() > 0
    assert not any(o is engine for o in gc.get_objects()), "a frozen object is still scanned"
assert gc.get_freeze_count() == 0
del engine
assert gc.collect() > 0, "the dropped engine's cycle was not freed"
print("ok")
"""


def test_startup_objects_frozen_for_a_block_then_collectable() -> None:
    out = subprocess.run([sys.executable, "-c", SCOPED_SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


MALLOC_SCRIPT = """
import ctypes, sys
from loom.process_tuning import keep_freed_memory

class MallInfo2(ctypes.Structure):  # glibc >= 2.33
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "keep":
    assert keep_freed_memory()
block = libc.malloc(64 << 20)  # a 64 MiB activation-sized block
info = libc.mallinfo2()
print(info.hblkhd >= 64 << 20)  # served by its own mmap (given back to the kernel on free)?
libc.free(ctypes.c_void_p(block))
"""


def test_keep_freed_memory_serves_big_blocks_from_the_heap() -> None:
    def mapped_alone(mode: str) -> bool:
        out = subprocess.run([sys.executable, "-c", MALLOC_SCRIPT, mode], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip() == "True"

    # by default glibc maps a block this big on its own and unmaps it on free, so the next one
    # faults fresh pages in; kept, it comes from the heap, which is never trimmed
    assert mapped_alone("plain") and not mapped_alone("keep")
