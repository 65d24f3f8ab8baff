"""A CUDA stream that waits for a word in page-locked host memory to reach a value.

Why: with a grammar process, a step's sampling reads bitmask rows that another process writes
into page-locked shared memory, and the copy of them to the device reads that memory when the
stream executes it, not when it is queued. If the stream waits for a word the writer sets after
the rows, the engine can queue the copy and the sampling before the rows exist and go on with
its host work, instead of blocking its thread until they do (loom.structured.grammar_process,
``LOOM_GRAMMAR_DEVICE_WAIT``).

How: the CUDA driver's ``cuStreamWaitValue32`` (a stream memory operation), called through
``ctypes`` on ``libcuda``: the stream does not run the work queued after it until the 32-bit word
at a device-visible address is >= the value. The word's address is its device pointer
(``cuMemHostGetDevicePointer`` on memory registered with ``cudaHostRegister``, which on a system
with unified addressing maps it for the device). :func:`available` probes it once per device: a
driver or device without stream memory operations, or a failed call, leaves the feature off.

The writer must store the rows before the word. A process on x86 keeps its stores in that order
for every other observer, the GPU's reads of host memory included.
"""

from __future__ import annotations

import ctypes
import functools
import time

import structlog
import torch

log = structlog.get_logger(__name__)

_CU_STREAM_WAIT_VALUE_GEQ = 0x0  # (word - value) as signed 32 bits >= 0: a later value also releases it
_CUDA_SUCCESS = 0


@functools.cache
def _driver() -> ctypes.CDLL | None:
    """``libcuda`` with the two entry points typed, or None where it does not load."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        wait = lib.cuStreamWaitValue32_v2
        pointer = lib.cuMemHostGetDevicePointer_v2
    except (OSError, AttributeError):
        return None
    # CUresult cuStreamWaitValue32_v2(CUstream, CUdeviceptr addr, cuuint32_t value, unsigned int flags)
    wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    wait.restype = ctypes.c_int
    # CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *pdptr, void *p, unsigned int flags)
    pointer.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    pointer.restype = ctypes.c_int
    return lib


def device_pointer(host_ptr: int) -> int:
    """The device address of registered host memory at ``host_ptr`` (in the current context)."""
    lib = _driver()
    if lib is None:
        raise RuntimeError("libcuda is not loadable")
    out = ctypes.c_uint64(0)
    rc = lib.cuMemHostGetDevicePointer_v2(ctypes.byref(out), ctypes.c_void_p(host_ptr), 0)
    if rc != _CUDA_SUCCESS:
        raise RuntimeError(f"cuMemHostGetDevicePointer failed (CUresult {rc})")
    return out.value


def wait_value(stream: torch.cuda.Stream, device_ptr: int, value: int) -> None:
    """Queue on ``stream`` a wait until the int32 word at ``device_ptr`` is >= ``value``
    (compared as serial numbers: ``value`` may wrap)."""
    lib = _driver()
    if lib is None:
        raise RuntimeError("libcuda is not loadable")
    rc = lib.cuStreamWaitValue32_v2(ctypes.c_void_p(stream.cuda_stream), device_ptr, value & 0xFFFFFFFF,
                                    _CU_STREAM_WAIT_VALUE_GEQ)
    if rc != _CUDA_SUCCESS:
        raise RuntimeError(f"cuStreamWaitValue32 failed (CUresult {rc})")


@functools.cache
def available(device_index: int) -> bool:
    """Whether a stream of CUDA device ``device_index`` can wait on registered host memory: a word
    is registered, a wait for a value it does not hold yet is queued, the word is set from the
    host, and the stream must then finish within a second."""
    if not torch.cuda.is_available() or torch.version.hip is not None or _driver() is None:
        return False
    from loom.worker.staging import HostRegistration

    word = torch.zeros(1024, dtype=torch.int32)  # a page of its own
    reg = HostRegistration.of(word)
    if reg is None:
        return False
    try:
        with torch.cuda.device(device_index):
            stream = torch.cuda.Stream()
            wait_value(stream, device_pointer(word.data_ptr()), 1)
            done = torch.cuda.Event()
            done.record(stream)
            time.sleep(0.001)
            if done.query():  # it did not wait for the word
                log.warning("a CUDA stream did not wait for a host word: the grammar rows are waited for on the host")
                return False
            word[0] = 1
            deadline = time.monotonic() + 1.0
            while not done.query():
                if time.monotonic() > deadline:
                    log.warning("a CUDA stream waiting for a host word was not released within a second: "
                                "the grammar rows are waited for on the host")
                    word[0] = 1 << 30  # (whatever it waits for, let it go before the word is unregistered)
                    return False
                time.sleep(0.0001)
        return True
    except RuntimeError as exc:
        log.info("CUDA stream memory operations are not available: the grammar rows are waited for on the host",
                 error=str(exc))
        return False
    finally:
        reg.release()
