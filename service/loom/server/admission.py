"""Admission control in the application: a bounded number of generation requests in the engine,
and a bounded wait queue in front of it.

gRPC's own ``maximum_concurrent_rpcs`` would also turn away health checks and reflection, and
answers with a bare status; here only generation counts. At most ``max_concurrent_requests``
requests hold a slot (are in the engine) at once; beyond that up to ``max_queue`` wait for one,
lowest ``priority`` first and first come first served within a priority. Only when that queue is
full does a client get RESOURCE_EXHAUSTED with a RetryInfo (TGI answers an immediate 429 at its
limit; queueing here absorbs bursts instead). A waiting request whose client cancels or whose
deadline passes leaves the queue at once. A request that has waited longer than
``max_queue_age_s`` goes next whatever its priority, so low priorities never starve.

While draining, new requests get UNAVAILABLE so clients retry on another replica; requests
already queued are still served, and :meth:`wait_idle` tells shutdown when the last one is done.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import grpc
import structlog

from .errors import ServiceError, overloaded, unavailable

log = structlog.get_logger(__name__)


@dataclass(order=True)
class _Waiter:
    priority: int
    seq: int  # arrival order: FIFO within a priority
    arrived: float = field(compare=False)
    future: asyncio.Future[None] = field(compare=False)

    @property
    def live(self) -> bool:
        return not self.future.done()


class Admission:
    def __init__(self, max_concurrent_requests: int, max_queue: int = 1024, retry_after_s: float = 1.0,
                 max_queue_age_s: float = 60.0) -> None:
        self.limit = max_concurrent_requests
        self.max_queue = max_queue
        self.retry_after_s = retry_after_s
        self.max_queue_age_s = max_queue_age_s
        self.in_flight = 0  # requests holding a slot
        self.queued = 0  # live waiters
        self.ready = False
        self.draining = False
        # Two views of the same waiters, both with lazy deletion (a cancelled waiter's future is
        # done): by (priority, arrival) for the normal pick, by arrival alone for the age bound.
        self._heap: list[_Waiter] = []
        self._fifo: deque[_Waiter] = deque()
        self._seq = itertools.count()
        self._idle = asyncio.Event()
        self._idle.set()

    def check(self) -> None:
        """Raise the status to answer with if a new request cannot be admitted or queued now.

        Cheap, so the servicer calls it before validating (tokenizing) a request; :meth:`slot`
        checks again, atomically with taking a place.
        """
        if self.draining:
            raise unavailable("the server is shutting down; retry on another replica", "DRAINING")
        if not self.ready:
            raise unavailable("the server is still loading the model; retry shortly", "NOT_READY")
        if self.in_flight >= self.limit and self.queued >= self.max_queue:
            if self.max_queue == 0:
                message = (f"the server is at its limit of {self.limit} concurrent requests "
                           "(--max-concurrent-requests) and has no wait queue (--max-queue 0); retry later")
            else:
                message = (f"the server is at its limit of {self.limit} concurrent requests "
                           f"(--max-concurrent-requests) and its wait queue of {self.max_queue} is full "
                           "(--max-queue); retry later")
            raise overloaded(message, self.retry_after_s)

    @asynccontextmanager
    async def slot(self, priority: int = 0, timeout: float | None = None) -> AsyncIterator[None]:
        """Hold one slot for the duration of a request, waiting in the queue if all are taken.

        Raises the status to answer with: UNAVAILABLE, RESOURCE_EXHAUSTED (queue full), or
        DEADLINE_EXCEEDED when ``timeout`` seconds pass while queued. A cancel while queued
        (client cancel, disconnect, deadline seen by gRPC) removes the request from the queue.
        """
        self.check()
        if self.in_flight < self.limit and self.queued == 0:
            self.in_flight += 1
        else:
            await self._wait(priority, timeout)
        self._idle.clear()
        try:
            yield
        finally:
            self._release()

    async def _wait(self, priority: int, timeout: float | None) -> None:
        waiter = _Waiter(priority, next(self._seq), time.monotonic(), asyncio.get_running_loop().create_future())
        heapq.heappush(self._heap, waiter)
        self._fifo.append(waiter)
        self.queued += 1
        self._idle.clear()
        log.debug("request queued", queued=self.queued, in_flight=self.in_flight, priority=priority)
        try:
            if timeout is None:
                await waiter.future
            else:
                await asyncio.wait_for(asyncio.shield(waiter.future), max(0.0, timeout))
        except BaseException as exc:
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is not None:
                raise  # ended by close(), which already took it out of the count
            if waiter.future.done() and not waiter.future.cancelled():
                # The slot was handed over just as the wait ended: pass it on.
                self._release()
            else:
                waiter.future.cancel()
                self.queued -= 1
                self._set_idle_if_empty()
                self._compact()
            if isinstance(exc, asyncio.TimeoutError):
                raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   "the request's deadline passed while it waited in the queue",
                                   "QUEUE_DEADLINE_EXCEEDED") from None
            raise
        log.debug("request dequeued", waited_ms=round((time.monotonic() - waiter.arrived) * 1000, 1))

    def _next_waiter(self) -> _Waiter | None:
        while self._fifo and not self._fifo[0].live:
            self._fifo.popleft()
        if self._fifo and time.monotonic() - self._fifo[0].arrived > self.max_queue_age_s:
            return self._fifo.popleft()  # too old: it goes next, whatever its priority
        while self._heap:
            waiter = heapq.heappop(self._heap)
            if waiter.live:
                return waiter
        return None

    def _release(self) -> None:
        waiter = self._next_waiter()
        if waiter is not None:
            # Hand the slot over directly: in_flight stays the same, and no newcomer can take
            # the slot between this release and the waiter's wake-up.
            self.queued -= 1
            waiter.future.set_result(None)
            return
        self.in_flight -= 1
        self._set_idle_if_empty()

    def _set_idle_if_empty(self) -> None:
        if self.in_flight == 0 and self.queued == 0:
            self._idle.set()
            self._heap.clear()
            self._fifo.clear()

    def _compact(self) -> None:
        # Cancelled waiters stay in both views until they reach a front; many cancels with no
        # release in between (a burst of short deadlines) would let them pile up.
        if len(self._heap) > 2 * self.queued + 64:
            self._heap = [w for w in self._heap if w.live]
            heapq.heapify(self._heap)
            self._fifo = deque(w for w in self._fifo if w.live)

    def close(self, error: ServiceError) -> int:
        """Stop admitting, and end every queued request with ``error``; returns how many."""
        self.draining = True
        ended = 0
        for waiter in self._fifo:
            if waiter.live:
                waiter.future.set_exception(error)
                ended += 1
        self.queued -= ended
        self._heap.clear()
        self._fifo.clear()
        self._set_idle_if_empty()
        return ended

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight or queued; False if ``timeout`` seconds passed first."""
        if self.in_flight == 0 and self.queued == 0:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True
