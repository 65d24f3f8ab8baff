"""Per-rank step counters in shared memory, read by the engine's watchdog.

A file of ``1 + world_size`` int64 slots (in /dev/shm when it exists): slot 0 is the number of
the last command the engine sent to the ranks, slot ``1 + r`` the last one rank r finished. A
rank whose slot stays behind for longer than the step timeout is the one that hangs; no message
has to travel to find out, so a rank stopped in a collective (or by SIGSTOP) is named as surely
as one that died.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path


class StepProgress:
    def __init__(self, path: Path, world_size: int, create: bool = False) -> None:
        self.path, self.world_size = path, world_size
        size = 8 * (1 + world_size)
        if create:
            path.write_bytes(bytes(size))
        self._file = open(path, "r+b")  # noqa: SIM115 (mapped for the object's life)
        self._map = mmap.mmap(self._file.fileno(), size)
        self._slots = memoryview(self._map).cast("q")

    @classmethod
    def create(cls, world_size: int) -> StepProgress:
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, name = tempfile.mkstemp(prefix="loom-shards-", dir=folder)
        os.close(fd)
        return cls(Path(name), world_size, create=True)

    @property
    def issued(self) -> int:
        return int(self._slots[0])

    def issue(self, seq: int) -> None:
        self._slots[0] = seq

    def done(self, rank: int) -> int:
        return int(self._slots[1 + rank])

    def mark_done(self, rank: int, seq: int) -> None:
        self._slots[1 + rank] = seq

    def close(self, unlink: bool = False) -> None:
        self._slots.release()
        self._map.close()
        self._file.close()
        if unlink:
            self.path.unlink(missing_ok=True)
