"""One long-lived thread that runs a step's bitmask fill while the engine's thread works on.

xgrammar's batch calls run in C++ with the interpreter lock released (tvm_ffi releases it
around every call unless ``TVM_FFI_RELEASE_GIL_BY_DEFAULT=0``), so a fill started here proceeds
on another core while the engine's thread processes the previous step's outputs in Python; the
engine joins it just before the sampling that needs the rows is queued. Only the C++ call runs
here: a few lines of Python before and after it, nothing else (an earlier design that ran the
driver's Python on a thread competed with the engine's thread for the lock and was slower).

The hand-off is cheap: the thread is made once and waits on a queue (no thread a step). A woken
thread still needs the interpreter lock to start its call and to return from it, and CPython
makes a thread that holds the lock give it up only every ``sys.getswitchinterval()`` (5 ms by
default) unless it blocks; the engine's thread runs pure Python meanwhile. So while a fill is in
flight the switch interval is lowered to :data:`SWITCH_INTERVAL_S` and restored at the join:
the thread waits at most that long for the lock, twice a step, instead of up to 5 ms.
"""

from __future__ import annotations

import queue
import sys
import threading
import weakref
from collections.abc import Callable

# While a fill is in flight: how long the fill's thread may wait for the interpreter lock before
# the engine's thread is asked to let it go (CPython's default is 5 ms).
SWITCH_INTERVAL_S = 5e-5

# Fills in flight in this process, and the switch interval to restore when the last one is
# joined (several drivers in one process, as in tests, must not leave the short interval set).
_lowered = threading.Lock()
_in_flight = 0
_saved_interval = 0.0


def _lower_switch_interval() -> None:
    global _in_flight, _saved_interval
    with _lowered:
        if _in_flight == 0:
            _saved_interval = sys.getswitchinterval()
            sys.setswitchinterval(min(_saved_interval, SWITCH_INTERVAL_S))
        _in_flight += 1


def _restore_switch_interval() -> None:
    global _in_flight
    with _lowered:
        _in_flight -= 1
        if _in_flight == 0:
            sys.setswitchinterval(_saved_interval)


def _serve(jobs: queue.SimpleQueue[Callable[[], None] | None],
           results: queue.SimpleQueue[BaseException | None]) -> None:
    """The thread's loop (it holds no reference to its :class:`FillThread`, which can be freed)."""
    while True:
        job = jobs.get()
        if job is None:
            return
        try:
            job()
        except BaseException as exc:  # handed to the joining thread, which raises it
            results.put(exc)
        else:
            results.put(None)
        del job  # (not kept alive, with what it refers to, while the thread waits for the next)


class FillThread:
    """Runs one job at a time on a daemon thread: :meth:`start`, then :meth:`join`."""

    def __init__(self, name: str = "loom-grammar-fill") -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=_serve, args=(self._jobs, self._results), name=name, daemon=True)
        self._thread.start()
        self._busy = False
        weakref.finalize(self, self._jobs.put, None)  # the thread ends with its owner

    @property
    def busy(self) -> bool:
        """Whether a job was started and not joined yet."""
        return self._busy

    def start(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the thread; :meth:`join` must follow before the next start."""
        assert not self._busy, "one job at a time"
        self._busy = True
        _lower_switch_interval()
        self._jobs.put(job)

    def join(self) -> None:
        """Wait for the started job (nothing when none is); re-raises what it raised."""
        if not self._busy:
            return
        try:
            error = self._results.get()
        finally:
            self._busy = False
            _restore_switch_interval()
        if error is not None:
            raise error

    def close(self) -> None:
        """Join the job in flight and end the thread."""
        self.join()
        self._jobs.put(None)
        self._thread.join()
