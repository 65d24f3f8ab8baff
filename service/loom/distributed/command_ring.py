"""The engine's commands to the other tensor-parallel ranks through a ring in shared memory.

One writer (rank 0's engine) and ``world_size - 1`` readers. Each command is pickled once and
written into the next of ``num_slots`` slots of a file mapped by every rank (in /dev/shm when it
exists); a reader polls for it, unpickles it and acknowledges it. A gloo ``broadcast_object_list``
of the same command cost 1.1-1.8 ms a step on the 2-core development VM (two messages through
TCP: the size, then the payload), next to a GPU decode step of a few milliseconds; the ring costs
a copy into the map and a poll (``scripts/bench_command_ring.py`` measures both side by side).

Layout (little-endian int64 words; each counter on its own 64-byte line):

- ``[0]``: the sequence number of the last command written (0: none yet);
- ``[8 * (1 + r)]``: the last sequence number reader ``r`` has taken (r = 1 .. world_size - 1);
- then ``num_slots`` slots of ``slot_bytes``: ``seq`` (int64), ``length`` (int64; ``-1``: the
  command was too large for a slot and follows over the gloo group), the pickled bytes.

Command ``s`` goes to slot ``s % num_slots``; the writer reuses a slot only once every reader has
taken the command written there before (so a reader at most ``num_slots`` commands behind never
loses one). The writer stores the payload, then the slot's header, then the counter; on x86-64,
whose stores become visible to other cores in program order and whose loads are not reordered
with older loads, a reader that sees the counter sees the payload. Other architectures keep the
gloo broadcast (:func:`supported`).

Waiting: a reader polls for 2 ms (a step's command is due within the engine's host time for a
step), then sleeps in steps of at most 0.05 ms, growing to 1 ms once it has waited 50 ms (an idle
server costs no core); the writer waits only when a reader is ``num_slots`` commands
behind, and gives up when ``abort()`` names a reason (the engine's watchdog saw a rank die or
hang).
"""

from __future__ import annotations

import mmap
import os
import pickle
import platform
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_LINE = 64  # bytes: one counter a cache line
_HEADER = 16  # a slot's seq and length
_LARGE = -1  # length of a command sent over gloo instead
_SPIN_S = 2e-3  # polling before the first sleep
_BUSY_SLEEP_S = 5e-5  # the longest sleep while the wait is short (a step's command is due)
_IDLE_AFTER_S = 0.05  # waiting longer than this, the server is idle: sleeps grow to _IDLE_SLEEP_S
_IDLE_SLEEP_S = 1e-3


def supported() -> bool:
    """Whether this machine's memory order makes the ring safe without fences (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def _poll(ready: Callable[[], bool], abort: Callable[[], str | None]) -> None:
    """Until ``ready()``: spin, then sleep in steps that stay short while the wait is short (a
    rank waiting for the next step's command) and grow once it is long (an idle server)."""
    began = time.monotonic()
    while not ready():
        if time.monotonic() - began > _SPIN_S:
            break
    else:
        return
    sleep = 1e-5
    while not ready():
        reason = abort()
        if reason is not None:
            raise RingAborted(reason)
        time.sleep(sleep)
        cap = _BUSY_SLEEP_S if time.monotonic() - began < _IDLE_AFTER_S else _IDLE_SLEEP_S
        sleep = min(cap, sleep * 2)


class RingAborted(RuntimeError):
    """The writer stopped waiting for a reader: ``abort()`` gave the reason."""


class CommandRing:
    def __init__(self, path: Path, world_size: int, rank: int, num_slots: int = 8, slot_bytes: int = 1 << 20,
                 create: bool = False) -> None:
        if world_size < 2:
            raise ValueError("a command ring needs at least one reader")
        self.path, self.world_size, self.rank = path, world_size, rank
        self.num_slots, self.slot_bytes = num_slots, slot_bytes
        self._slots_at = _LINE * world_size
        size = self._slots_at + num_slots * slot_bytes
        if create:
            with open(path, "wb") as f:
                f.truncate(size)  # zeros: no command yet, every reader at 0
        self._file = open(path, "r+b")  # noqa: SIM115 (mapped for the object's life)
        self._map = mmap.mmap(self._file.fileno(), size)
        self._seq = 0  # the last command this side wrote (writer) or took (reader)

    @classmethod
    def create(cls, world_size: int, **kwargs: Any) -> CommandRing:
        if world_size < 2:
            raise ValueError("a command ring needs at least one reader")
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, name = tempfile.mkstemp(prefix="loom-commands-", dir=folder)
        os.close(fd)
        return cls(Path(name), world_size, 0, create=True, **kwargs)

    # -- the counters --------------------------------------------------------------------------------
    def _word(self, offset: int) -> int:
        return int(struct.unpack_from("<q", self._map, offset)[0])

    def _set_word(self, offset: int, value: int) -> None:
        struct.pack_into("<q", self._map, offset, value)

    def _written(self) -> int:
        return self._word(0)

    def _taken(self, reader: int) -> int:
        return self._word(_LINE * reader)

    # -- rank 0 ------------------------------------------------------------------------------------------
    def send(self, obj: Any, large: Callable[[Any], None], abort: Callable[[], str | None]) -> None:
        """Write ``obj`` for every reader. A command larger than a slot is announced in the ring and
        handed to ``large`` (which must broadcast it over the process group). Raises
        :class:`RingAborted` if ``abort()`` names a reason while a reader is behind."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        seq = self._seq + 1
        oldest = seq - self.num_slots  # the command this slot held last: every reader must have it
        if oldest > 0:
            self._wait(lambda: min(self._taken(r) for r in range(1, self.world_size)) >= oldest, abort)
        slot = self._slots_at + (seq % self.num_slots) * self.slot_bytes
        fits = len(data) <= self.slot_bytes - _HEADER
        if fits:
            self._map[slot + _HEADER : slot + _HEADER + len(data)] = data
        struct.pack_into("<qq", self._map, slot, seq, len(data) if fits else _LARGE)
        self._set_word(0, seq)  # publish: after the payload and the header
        self._seq = seq
        if not fits:
            large(obj)

    def _wait(self, ready: Callable[[], bool], abort: Callable[[], str | None]) -> None:
        _poll(ready, abort)

    # -- the other ranks -------------------------------------------------------------------------------
    def recv(self, large: Callable[[], Any]) -> Any:
        """The next command (waiting for it); ``large()`` receives one that came over the group."""
        seq = self._seq + 1
        _poll(lambda: self._written() >= seq, lambda: None)
        slot = self._slots_at + (seq % self.num_slots) * self.slot_bytes
        slot_seq, length = struct.unpack_from("<qq", self._map, slot)
        if slot_seq != seq:
            raise RuntimeError(f"command ring out of step: slot holds command {slot_seq}, expected {seq}")
        obj = large() if length == _LARGE else pickle.loads(self._map[slot + _HEADER : slot + _HEADER + length])
        self._seq = seq
        self._set_word(_LINE * self.rank, seq)  # taken: the writer may reuse the slot
        return obj

    def close(self, unlink: bool = False) -> None:
        self._map.close()
        self._file.close()
        if unlink:
            self.path.unlink(missing_ok=True)
