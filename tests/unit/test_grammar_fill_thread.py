"""The structured-output driver's fill thread: one job at a time, errors re-raised at the join,
the switch interval lowered only while a job is in flight, the thread gone with its owner."""

from __future__ import annotations

import gc
import sys
import threading
import time

import pytest

from loom.structured.fill_thread import SWITCH_INTERVAL_S, FillThread


def test_a_job_runs_on_the_thread_and_the_join_waits_for_it() -> None:
    before = sys.getswitchinterval()
    ran: list[str] = []
    thread = FillThread()

    def job() -> None:
        time.sleep(0.01)
        ran.append(threading.current_thread().name)

    thread.start(job)
    assert thread.busy and sys.getswitchinterval() == pytest.approx(min(before, SWITCH_INTERVAL_S))
    thread.join()
    assert ran == ["loom-grammar-fill"] and not thread.busy and sys.getswitchinterval() == pytest.approx(before)
    thread.join()  # nothing in flight: returns at once
    thread.close()


def test_an_error_is_raised_at_the_join_and_the_thread_goes_on() -> None:
    before = sys.getswitchinterval()
    thread = FillThread()

    def fail() -> None:
        raise RuntimeError("xgrammar refused")

    thread.start(fail)
    with pytest.raises(RuntimeError, match="xgrammar refused"):
        thread.join()
    assert sys.getswitchinterval() == pytest.approx(before)
    done: list[int] = []
    thread.start(lambda: done.append(1))
    thread.join()
    assert done == [1]
    thread.close()


def test_two_threads_in_flight_restore_the_interval_once_both_are_joined() -> None:
    before = sys.getswitchinterval()
    a, b = FillThread(), FillThread()
    a.start(lambda: None)
    b.start(lambda: None)
    a.join()
    assert sys.getswitchinterval() == pytest.approx(min(before, SWITCH_INTERVAL_S))  # b is still in flight
    b.join()
    assert sys.getswitchinterval() == pytest.approx(before)
    a.close()
    b.close()


def test_the_thread_ends_with_its_owner() -> None:
    thread = FillThread()
    thread.start(lambda: None)
    thread.join()
    worker = thread._thread
    del thread
    gc.collect()
    worker.join(timeout=5)
    assert not worker.is_alive()
