"""The bitmask rows a grammar process fills and the engine copies to the device, in memory both see.

Two halves of [capacity, ceil(V / 32)] int32 rows in one ``memfd`` mapping, used in turn: a step's
rows are read by the device copy of its sampling while the next step's are written into the other
half. The engine maps the memory, page-locks it for the GPU where asked (a copy from it is then a
queued DMA, not a memcpy through the stager's buffers on the host thread), and hands its file
descriptor to each grammar process, which maps the same pages. Several grammar processes share one
mapping (:class:`~loom.structured.grammar_group.GrammarProcessGroup`), each writing its own rows at
the places the engine assigns, so a step's rows are one block whoever filled them.

A page after the rows holds a word, the *fill flag*: a grammar process told to signal its fill
(``LOOM_GRAMMAR_DEVICE_WAIT``) writes the step's fill id there after its rows, and the device's
stream waits for it before copying them (:mod:`loom.worker.stream_wait`).
"""

from __future__ import annotations

import mmap
import os

import structlog
import torch

from loom.worker.staging import HostRegistration

log = structlog.get_logger(__name__)


FLAG_PAGE_BYTES = 4096  # after the two halves: the fill flag (int32 word 0) on a page of its own


def mapping_bytes(capacity: int, words: int) -> int:
    """The mapping's size: two halves of ``capacity`` rows of ``words`` int32, then the flag page."""
    return 2 * capacity * words * 4 + FLAG_PAGE_BYTES


class SharedRows:
    """The mapping, grown (replaced) when a step needs more rows than it has.

    ``generation`` counts replacements: a grammar process maps the current one when the count it
    last mapped differs (a new mapping, or a process started since)."""

    def __init__(self, words: int, register: bool = False) -> None:
        self.words = words  # int32 words a row
        self.register = register  # page-lock for the GPU (the engine's device is CUDA)
        self.capacity = 0  # rows a half
        self.generation = 0
        self.fd: int | None = None  # the memfd, kept open to hand to a process started later
        self.views: list[torch.Tensor] = []  # the two halves, [capacity, words] int32 each
        self.flag: torch.Tensor | None = None  # [1] int32: the fill flag (the last signalled fill id)
        self._buffer: mmap.mmap | None = None
        self._registration: HostRegistration | None = None

    @property
    def registered(self) -> bool:
        return self._registration is not None

    def reserve(self, rows: int) -> bool:
        """At least ``rows`` rows a half; True when the mapping was replaced (every process must
        map the new one before it fills rows again)."""
        if rows <= self.capacity:
            return False
        capacity = max(rows, 2 * self.capacity, 64)
        size = mapping_bytes(capacity, self.words)
        fd = os.memfd_create("loom-grammar-rows")
        try:
            os.ftruncate(fd, size)
            buffer = mmap.mmap(fd, size)
        except OSError:
            os.close(fd)
            raise
        self.release()  # (after the device has run every copy queued from the old one)
        self.fd, self._buffer, self.capacity = fd, buffer, capacity
        n = capacity * self.words
        self.views = [torch.frombuffer(buffer, dtype=torch.int32, count=n, offset=i * n * 4).view(capacity, self.words)
                      for i in range(2)]
        self.flag = torch.frombuffer(buffer, dtype=torch.int32, count=1, offset=2 * n * 4)
        if self.register:
            self._registration = HostRegistration.of(
                torch.frombuffer(buffer, dtype=torch.int32, count=size // 4))
            if self._registration is None:
                log.warning("the grammar rows could not be page-locked: they are staged through a copy a step")
        self.generation += 1
        return True

    def release(self) -> None:
        """Unregister and close the mapping's descriptor (the mapping itself goes with its views)."""
        if self._registration is not None:
            self._registration.release()
            self._registration = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
