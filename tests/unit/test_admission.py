"""The admission queue in-process: slots, FIFO and priority order, queue-full, cancel and deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc
import pytest

from loom.server.admission import Admission
from loom.server.errors import ServiceError


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 10))


def ready(limit: int, queue: int, **kw: float) -> Admission:
    a = Admission(limit, queue, **kw)
    a.ready = True
    return a


async def hold(a: Admission, name: str, order: list[str], release: asyncio.Event, priority: int = 0,
               timeout: float | None = None) -> None:
    async with a.slot(priority, timeout):
        order.append(name)
        await release.wait()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_waiters_run_fifo_within_a_priority_and_by_priority_across() -> None:
    async def body() -> None:
        a = ready(1, 10)
        order: list[str] = []
        gates = {n: asyncio.Event() for n in "abcde"}
        tasks = [asyncio.create_task(hold(a, "a", order, gates["a"]))]
        await settle()
        for name, prio in (("b", 5), ("c", 0), ("d", 5), ("e", -1)):
            tasks.append(asyncio.create_task(hold(a, name, order, gates[name], priority=prio)))
            await settle()
        assert order == ["a"] and a.in_flight == 1 and a.queued == 4
        for name in "aecbd":
            gates[name].set()
            await settle()
        await asyncio.gather(*tasks)
        assert order == ["a", "e", "c", "b", "d"]
        assert a.in_flight == 0 and a.queued == 0 and await a.wait_idle(0)

    run(body)


def test_queue_full_is_resource_exhausted_with_retry_after() -> None:
    async def body() -> None:
        a = ready(1, 1)
        gate = asyncio.Event()
        order: list[str] = []
        first = asyncio.create_task(hold(a, "a", order, gate))
        await settle()
        second = asyncio.create_task(hold(a, "b", order, gate))
        await settle()
        with pytest.raises(ServiceError) as info:
            a.check()
        assert info.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and info.value.retry_after_s
        assert "--max-queue" in info.value.message
        gate.set()
        await asyncio.gather(first, second)
        assert order == ["a", "b"]

    run(body)


def test_no_queue_rejects_at_once() -> None:
    async def body() -> None:
        a = ready(1, 0)
        gate = asyncio.Event()
        task = asyncio.create_task(hold(a, "a", [], gate))
        await settle()
        with pytest.raises(ServiceError) as info:
            async with a.slot():
                pass
        assert info.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        gate.set()
        await task

    run(body)


def test_cancel_and_deadline_leave_the_queue_at_once() -> None:
    async def body() -> None:
        a = ready(1, 2)
        gate = asyncio.Event()
        order: list[str] = []
        running = asyncio.create_task(hold(a, "a", order, gate))
        await settle()
        cancelled = asyncio.create_task(hold(a, "x", order, gate))
        expiring = asyncio.create_task(hold(a, "y", order, gate, timeout=0.05))
        await settle()
        assert a.queued == 2
        cancelled.cancel()
        await settle()
        assert a.queued == 1
        with pytest.raises(ServiceError) as info:
            await expiring
        assert info.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
        assert a.queued == 0
        # Both places are free again: two more fit in the queue.
        later = [asyncio.create_task(hold(a, n, order, gate)) for n in "bc"]
        await settle()
        assert a.queued == 2
        gate.set()
        await asyncio.gather(running, *later)
        assert order == ["a", "b", "c"] and a.in_flight == 0

    run(body)


def test_old_waiter_outranks_priority() -> None:
    async def body() -> None:
        a = ready(1, 5, max_queue_age_s=0.05)
        order: list[str] = []
        gates = {n: asyncio.Event() for n in "abc"}
        tasks = [asyncio.create_task(hold(a, "a", order, gates["a"]))]
        await settle()
        tasks.append(asyncio.create_task(hold(a, "b", order, gates["b"], priority=9)))
        await asyncio.sleep(0.1)
        tasks.append(asyncio.create_task(hold(a, "c", order, gates["c"], priority=0)))
        await settle()
        for g in gates.values():
            g.set()
        await asyncio.gather(*tasks)
        assert order == ["a", "b", "c"]

    run(body)


def test_draining_refuses_new_but_serves_queued() -> None:
    async def body() -> None:
        a = ready(1, 2)
        gate = asyncio.Event()
        order: list[str] = []
        tasks = [asyncio.create_task(hold(a, n, order, gate)) for n in "ab"]
        await settle()
        a.draining = True
        with pytest.raises(ServiceError) as info:
            a.check()
        assert info.value.code is grpc.StatusCode.UNAVAILABLE
        assert not await a.wait_idle(0.01)
        gate.set()
        assert await a.wait_idle(1)
        await asyncio.gather(*tasks)
        assert order == ["a", "b"]

    run(body)


def test_many_cancelled_waiters_do_not_pile_up() -> None:
    async def body() -> None:
        a = ready(1, 10_000)
        gate = asyncio.Event()
        running = asyncio.create_task(hold(a, "a", [], gate))
        await settle()
        waiters = [asyncio.create_task(hold(a, str(i), [], gate)) for i in range(500)]
        await settle()
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        assert a.queued == 0 and len(a._heap) <= 64
        gate.set()
        await running

    run(body)


def test_close_ends_queued_requests_with_the_error_and_keeps_counts() -> None:
    async def body() -> None:
        from loom.server.errors import unavailable

        a = ready(1, 10)
        order: list[str] = []
        release = asyncio.Event()
        running = asyncio.create_task(hold(a, "running", order, release))
        await settle()
        queued = [asyncio.create_task(hold(a, f"q{i}", order, release, priority=i)) for i in range(3)]
        await settle()
        assert (a.in_flight, a.queued) == (1, 3)
        assert a.close(unavailable("grace period over", "SHUTDOWN")) == 3
        for task in queued:
            with pytest.raises(ServiceError) as info:
                await task
            assert info.value.code is grpc.StatusCode.UNAVAILABLE and info.value.reason == "SHUTDOWN"
        assert (a.in_flight, a.queued) == (1, 0) and a.draining
        with pytest.raises(ServiceError):
            a.check()  # nothing new is admitted
        release.set()
        await running
        assert order == ["running"] and await a.wait_idle(0)

    run(body)
