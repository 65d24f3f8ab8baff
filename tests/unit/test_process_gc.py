"""Start-up objects are frozen out of the garbage collector's reach (in a child process: freezing
the test process would change every later test's collections)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import gc
from loom.process_gc import freeze_startup_objects

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
