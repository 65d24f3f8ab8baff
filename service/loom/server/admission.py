"""Admission control in the application: a bounded number of generation requests at once.

gRPC's own ``maximum_concurrent_rpcs`` would also turn away health checks and reflection, and
answers with a bare status; here only generation counts, and an overloaded client gets
RESOURCE_EXHAUSTED with a RetryInfo. While draining, new requests get UNAVAILABLE so clients
retry on another replica, and :meth:`wait_idle` tells shutdown when the last one has finished.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from .errors import overloaded, unavailable


class Admission:
    def __init__(self, max_concurrent_requests: int, retry_after_s: float = 1.0) -> None:
        self.limit = max_concurrent_requests
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self.ready = False
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    @contextmanager
    def slot(self) -> Iterator[None]:
        """Hold one slot for the duration of a request, or raise the status to answer with."""
        if self.draining:
            raise unavailable("the server is shutting down; retry on another replica", "DRAINING")
        if not self.ready:
            raise unavailable("the server is still loading the model; retry shortly", "NOT_READY")
        if self.in_flight >= self.limit:
            raise overloaded(self.limit, self.retry_after_s)
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; False if ``timeout`` seconds passed first."""
        if self.in_flight == 0:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True
