"""Host <-> device transfers of a step's small arrays without stalling the host.

``torch.tensor(values, device="cuda")`` copies from pageable memory, which makes the host wait
until the copy has run, i.e. until every kernel queued before it has finished. A step makes a
dozen such tensors (token ids, positions, slots, block tables, sampler parameters), so the host
could never run ahead of the GPU. Here every array goes through *pinned* buffers allocated once
and reused: the host writes into them, the copy is queued without waiting, and the host moves
on to prepare the next step while the GPU works.

Buffers come in ``num_slots`` sets used round-robin, one set per step: a set is written again
only ``num_slots`` steps later, and the engine keeps at most one step in flight, so the copies
that read it have long finished. On the CPU nothing is staged: tensors are made directly.
"""

from __future__ import annotations

import array
import contextlib
from collections.abc import Sequence
from typing import Any

import torch

_INITIAL_ELEMS = 1 << 16
_ALIGN = 64  # elements


class _Slot:
    """Pinned host buffers and matching device buffers, one pair per dtype, bump-allocated."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host: dict[torch.dtype, torch.Tensor] = {}
        self.dev: dict[torch.dtype, torch.Tensor] = {}
        self.offset: dict[torch.dtype, int] = {}
        self.retired: list[torch.Tensor] = []  # outgrown buffers some queued copy may still use

    def reset(self) -> None:
        self.offset = dict.fromkeys(self.offset, 0)
        self.retired.clear()

    def take(self, dtype: torch.dtype, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        off = self.offset.get(dtype, 0)
        host = self.host.get(dtype)
        if host is None or off + n > host.numel():
            if host is not None:
                self.retired += [host, self.dev[dtype]]
            size = max(_INITIAL_ELEMS, 2 * (off + n))
            self.host[dtype] = host = torch.empty(size, dtype=dtype, pin_memory=True)
            self.dev[dtype] = torch.empty(size, dtype=dtype, device=self.device)
            off = 0
        # Keep every slice 64-element aligned: Triton specialises kernels on 16-byte pointer
        # alignment, and a misaligned slice would compile (and launch) another variant.
        self.offset[dtype] = off + -(-n // _ALIGN) * _ALIGN
        return host[off : off + n], self.dev[dtype][off : off + n]


class Stager:
    """``to_device(values, dtype)``: a device tensor holding ``values``, queued, not waited for."""

    def __init__(self, device: torch.device, num_slots: int = 3) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._slots = [_Slot(device) for _ in range(num_slots)] if self.pinned else []
        self._current = 0

    def next_step(self) -> None:
        """Start filling the next buffer set (call once per step, before its transfers)."""
        if self.pinned:
            self._current = (self._current + 1) % len(self._slots)
            self._slots[self._current].reset()

    def to_device(self, values: Sequence[Any] | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``values``: a tensor, or a (nested) list of numbers, as ``torch.tensor`` takes it."""
        cpu = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
        if not self.pinned:
            return cpu.to(dtype)
        flat = cpu.reshape(-1)
        host, dev = self._slots[self._current].take(dtype, flat.numel())
        host.copy_(flat)
        dev.copy_(host, non_blocking=True)
        return dev.view(cpu.shape)

    def after_host_word(self, word: torch.Tensor, value: int) -> None:
        """Copies queued from here on wait until the [1] int32 host ``word`` reaches ``value`` (as
        serial numbers): on CUDA the stream waits (``word`` in registered memory,
        :mod:`loom.worker.stream_wait`). On the CPU a copy runs at once, so the word must have
        reached it already (whoever hands such rows to a host sampler waits for them first)."""
        if self.pinned:
            from . import stream_wait

            # (looked up each time, ~2 us: a replaced mapping may be registered at the same address)
            stream_wait.wait_value(torch.cuda.current_stream(self.device), stream_wait.device_pointer(word.data_ptr()),
                                   value)
        elif ((int(word[0]) - value) & 0xFFFFFFFF) >= 1 << 31:  # word - value < 0, wrapping
            raise RuntimeError(f"rows read on the host before they were written (word {int(word[0])}, "
                               f"waiting for {value})")

    def from_registered(self, values: torch.Tensor) -> torch.Tensor:
        """A device copy of a host tensor in page-locked memory (:class:`HostRegistration`), queued
        straight from it: no copy into the stager's own pinned buffers first. The caller keeps
        ``values`` unwritten until the copy has run."""
        if not self.pinned:
            return values
        _, dev = self._slots[self._current].take(values.dtype, values.numel())
        dev.copy_(values.reshape(-1), non_blocking=True)
        return dev.view(values.shape)

    def to_device_many(self, arrays: Sequence[Sequence[int]], dtype: torch.dtype) -> list[torch.Tensor]:
        """Several flat integer arrays (``torch.int64`` or ``torch.int32``) in one transfer: one
        host buffer and one copy instead of one per array (each a tensor built from a list, a
        pinned write and a queued copy: a step stages about ten). Returns a device view of each,
        every one starting on a 64-element boundary as :meth:`_Slot.take` aligns its slices."""
        code = _ARRAY_CODES[dtype]
        flat = array.array(code)
        bounds = []
        for values in arrays:
            start = len(flat)
            flat.extend(values)
            bounds.append((start, len(flat)))
            flat.extend(_ZEROS[code][: -len(flat) % _ALIGN])
        if not flat:
            empty = torch.empty(0, dtype=dtype, device=self.device)
            return [empty for _ in arrays]
        staged = self.to_device(torch.frombuffer(flat, dtype=dtype), dtype)
        return [staged[a:b] for a, b in bounds]


_ARRAY_CODES = {torch.int64: "q", torch.int32: "i"}
_ZEROS = {code: array.array(code, bytes(array.array(code).itemsize * _ALIGN)) for code in _ARRAY_CODES.values()}


class DeviceToHost:
    """Queue device -> pinned host copies of a step's results; read them after ``wait()``."""

    def __init__(self, device: torch.device) -> None:
        self.pinned = device.type == "cuda"
        self.event: torch.cuda.Event | None = None

    def fetch(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if not self.pinned:
            return tensors
        out = []
        for t in tensors:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            out.append(host)
        self.event = torch.cuda.Event()
        self.event.record()
        return out

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class HostRegistration:
    """Host memory allocated elsewhere (an ``mmap``: the grammar process's shared bitmask rows)
    page-locked for the GPU with ``cudaHostRegister``, so that a copy from it to the device is a
    queued DMA. From pageable memory the same copy is a memcpy into a staging buffer on the host
    thread first (64 rows of a 49,152-token vocabulary: 393 KB, 35-80 us a step on the GPU hosts).

    Whoever writes the memory must not write a region a queued copy still reads; :meth:`release`
    waits for the device before unregistering, so no queued copy reads memory after that."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.ptr = tensor.data_ptr()
        self.size = tensor.numel() * tensor.element_size()
        self.device = torch.cuda.current_device()
        self._registered = False

    @classmethod
    def of(cls, tensor: torch.Tensor) -> HostRegistration | None:
        """``tensor``'s memory registered, or None where that fails (no CUDA, or the driver
        refuses): copies from it then stay staged, as from any pageable memory."""
        if not torch.cuda.is_available():
            return None
        reg = cls(tensor)
        rt = torch.cuda.cudart()
        if rt.cudaHostRegister(reg.ptr, reg.size, 0) != rt.cudaError.success:
            return None
        reg._registered = True
        return reg

    def release(self) -> None:
        if not self._registered:
            return
        self._registered = False
        # every copy queued from it has run (a device that failed runs nothing more: unregister anyway)
        with contextlib.suppress(RuntimeError):
            torch.cuda.synchronize(self.device)
        torch.cuda.cudart().cudaHostUnregister(self.ptr)
