"""grpc.health.v1 for the server ("") and the generation service, following the server's life.

NOT_SERVING while the model loads and warms up, SERVING once a generation has run, NOT_SERVING
again from the moment a drain starts (so load balancers stop routing before the server stops).
Check, Watch and List all answer; grpcio-health-checking's servicer (1.85) has no List, so the
generated base class's placeholder answered it (UNIMPLEMENTED, "Method not implemented!") while
reflection advertised it.
"""

from __future__ import annotations

import enum
from typing import Any

from grpc_health.v1 import health, health_pb2

GENERATION_SERVICE = "loom.v1.GenerationService"
HEALTH_SERVICE = "grpc.health.v1.Health"
SERVICES = ("", GENERATION_SERVICE)


class HealthServicer(health.aio.HealthServicer):
    """The library's asyncio servicer plus List: a snapshot of every service's status."""

    def __init__(self) -> None:
        super().__init__()
        self._services: dict[str, None] = {"": None}  # every name ever set, in order

    async def set(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        self._services.setdefault(service)
        await super().set(service, status)

    async def List(self, request: health_pb2.HealthListRequest, context: Any) -> health_pb2.HealthListResponse:
        response = health_pb2.HealthListResponse()
        for service in self._services:
            # Check is the library's own view, graceful shutdown included.
            checked = await self.Check(health_pb2.HealthCheckRequest(service=service), context)
            response.statuses[service].CopyFrom(checked)
        return response


class Phase(enum.Enum):
    LOADING = "loading"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


class ServerHealth:
    def __init__(self) -> None:
        self.servicer = HealthServicer()
        self.phase = Phase.LOADING

    @property
    def ready(self) -> bool:
        return self.phase is Phase.SERVING

    async def _set_all(self, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        for service in SERVICES:
            await self.servicer.set(service, status)

    async def loading(self) -> None:
        self.phase = Phase.LOADING
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)

    async def serving(self) -> None:
        self.phase = Phase.SERVING
        await self._set_all(health_pb2.HealthCheckResponse.SERVING)

    async def draining(self) -> None:
        """Permanent: later calls to serving() have no effect on what clients see."""
        self.phase = Phase.DRAINING
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.servicer.enter_graceful_shutdown()

    async def failed(self) -> None:
        self.phase = Phase.STOPPED
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.servicer.enter_graceful_shutdown()
