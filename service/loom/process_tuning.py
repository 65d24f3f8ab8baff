"""Process-level tuning of a started Loom process: the garbage collector and the C allocator.

**Garbage collector.** After start-up a process holds hundreds of thousands of objects that live until it exits
(torch modules, transformers and tokenizer state, protobuf descriptors). A full (generation 2)
collection walks all of them: measured here, 313k tracked objects in the engine process and
stalls of up to 118 ms on 2 cores; on the H200 host two stalls of 217 and 293 ms showed in one
llama-1b W2 run, with 512 sequences waiting on each. ``gc.freeze()`` moves every object alive
now into a permanent generation the collector never scans, so later collections only see what
serving allocates (outputs, per-request state). vLLM and SGLang do the same after start-up.

**C allocator (CPU engine).** glibc's malloc serves large blocks with ``mmap`` and returns them
on free, so every big activation tensor of a CPU forward comes back as fresh pages the kernel
must fault in and zero. Measured on 2 cores, one 4,096-token SmolLM2 prefill step took 380k to
750k minor page faults and 6.7-9.4 s; with freed memory kept in the heap, 50 faults and
6.0-6.3 s. The cost is that the process keeps its peak heap (vLLM's CPU backend recommends
tcmalloc for the same reason).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import sys
from collections.abc import Iterator


def freeze_startup_objects() -> int:
    """Collect once, then exempt every surviving object from later collections. Returns how
    many objects were frozen. Call it when start-up is over (model loaded, warm-up done)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextlib.contextmanager
def startup_objects_frozen() -> Iterator[int]:
    """For an engine run in-process and dropped afterwards (the C3 and W5 benchmarks): what is
    alive now is frozen for the block, as a started server freezes it for its life, so that no
    full collection stalls the timed steps (one took 198 ms in the middle of a CPU C3 request
    here; the H200's host measured 217-293 ms); afterwards the objects are handed back to the
    collector, so that a dropped engine's cycles (and its device memory) can still be freed."""
    frozen = freeze_startup_objects()
    try:
        yield frozen
    finally:
        gc.unfreeze()


_M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3


def keep_freed_memory() -> bool:
    """Make glibc's malloc reuse freed memory instead of unmapping it (see the module docstring):
    blocks up to 1 GiB come from the heap, and the heap is never trimmed. Returns whether it
    applied (False off Linux/glibc, where the allocator is left as it is)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
