"""Build and run the grpc.aio server: listen first, load the model, serve, drain on SIGTERM.

The port is bound before the model loads so that health checks answer NOT_SERVING during
loading instead of connection errors. Shutdown (SIGTERM or SIGINT): health goes NOT_SERVING, new
generation requests get UNAVAILABLE, in-flight ones get up to --graceful-termination-timeout to
finish, then the server stops and the engine process with it. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Sequence

import grpc
import structlog
from grpc_health.v1 import health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from loom.config import ConfigError
from loom.engine.core_process import AsyncEngineClient
from loom.logging_setup import configure_logging
from loom_client.v1 import generation_pb2_grpc as pb_grpc

from .admission import Admission
from .auth import auth_interceptors
from .health import GENERATION_SERVICE, HEALTH_SERVICE, ServerHealth
from .loading import load_backend
from .servicer import GenerationService
from .settings import ServerSettings
from .tls import server_credentials

log = structlog.get_logger(__name__)

SERVER_OPTIONS = [
    # On by default in gRPC: a second server on the same port would silently share the traffic.
    ("grpc.so_reuseport", 0),
]
_ENGINE_CHECK_INTERVAL_S = 1.0


def build_server(service: GenerationService, health: ServerHealth, *,
                 interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                 max_request_bytes: int = 4 << 20) -> grpc.aio.Server:
    # A larger message fails in gRPC itself with RESOURCE_EXHAUSTED, before it is even parsed.
    options = [*SERVER_OPTIONS, ("grpc.max_receive_message_length", max_request_bytes)]
    server = grpc.aio.server(interceptors=list(interceptors), options=options)
    pb_grpc.add_GenerationServiceServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    reflection.enable_server_reflection([GENERATION_SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME], server)
    return server


class LoomServer:
    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.health = ServerHealth()
        self.admission = Admission(settings.max_concurrent_requests, settings.max_queue,
                                   max_queue_age_s=settings.engine.max_queue_age_s)
        self.service = GenerationService(self.admission)
        self.server = build_server(self.service, self.health, interceptors=auth_interceptors(settings.api_key),
                                   max_request_bytes=settings.max_request_bytes)
        self.engine: AsyncEngineClient | None = None
        self.port = 0
        self._stop = asyncio.Event()
        self._signals = 0
        self._exit_code = 0

    def request_stop(self, signum: int | None = None) -> None:
        self._signals += 1
        log.info("shutdown requested", signal=signal.Signals(signum).name if signum else None, count=self._signals)
        self._stop.set()
        if self._signals > 1:  # a second signal: do not wait for in-flight requests
            self.admission.draining = True
            asyncio.get_running_loop().create_task(self.server.stop(0))

    async def run(self) -> int:
        s = self.settings
        try:
            self.port = self._listen()
        except ConfigError as exc:
            log.error("cannot listen", address=s.address, error=str(exc))
            return 2
        except RuntimeError as exc:
            log.error("cannot listen", address=s.address, error=str(exc))
            return 1
        await self.health.loading()
        await self.server.start()
        log.info("listening", address=s.address, port=self.port, tls=s.tls.enabled, mutual_tls=s.tls.mutual,
                 api_key=s.api_key is not None)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop, sig)

        load = asyncio.create_task(self._load())
        stop_wait = asyncio.create_task(self._stop.wait())
        await asyncio.wait({load, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        if not load.done():
            load.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await load
        elif load.exception() is not None:
            failure = load.exception()
            log.error("start-up failed", error=str(failure),
                      exc_info=failure if not isinstance(failure, ConfigError) else None)
            self._exit_code = 1
            self._stop.set()
        else:
            await self.health.serving()
            self.admission.ready = True
            log.info("serving", port=self.port)
            watchdog = asyncio.create_task(self._watch_engine())
            await self._stop.wait()
            watchdog.cancel()
        stop_wait.cancel()
        await self._shutdown()
        return self._exit_code

    def _listen(self) -> int:
        credentials = server_credentials(self.settings.tls)
        if credentials is None:
            return self.server.add_insecure_port(self.settings.address)
        return self.server.add_secure_port(self.settings.address, credentials)

    async def _load(self) -> None:
        self.engine = AsyncEngineClient(self.settings.engine, log_json=self.settings.json_output)
        backend = await load_backend(self.settings, self.engine)
        self.service.attach(backend)

    async def _watch_engine(self) -> None:
        assert self.engine is not None
        while self.engine.is_alive():
            await asyncio.sleep(_ENGINE_CHECK_INTERVAL_S)
        log.error("engine process is gone; stopping the server", reason=self.engine.dead)
        self._exit_code = 1
        self._stop.set()

    async def _shutdown(self) -> None:
        grace = self.settings.graceful_termination_timeout
        await self.health.draining()
        self.admission.draining = True
        in_flight = self.admission.in_flight
        if in_flight:
            log.info("draining", in_flight=in_flight, grace_s=grace)
        finished = await self.admission.wait_idle(grace if self._exit_code == 0 else 0)
        if not finished:
            log.warning("grace period over; cancelling requests", in_flight=self.admission.in_flight)
        # Requests still running now are cancelled; their handlers abort them in the engine.
        await self.server.stop(0.5)
        if self.engine is not None:
            await self._log_engine_stats()
            await self.engine.shutdown()
        log.info("stopped")

    async def _log_engine_stats(self) -> None:
        # A last look at the KV pool: every block should be free once no request is left.
        assert self.engine is not None
        if not self.engine.is_alive():
            return
        with contextlib.suppress(Exception):
            stats = await asyncio.wait_for(self.engine.stats(), 2.0)
            log.info("engine stats at shutdown", running=stats.num_running, waiting=stats.num_waiting,
                     free_blocks=stats.num_free_blocks, blocks=stats.num_blocks, steps=stats.num_steps)


def serve(settings: ServerSettings) -> int:
    """Run the server until it is shut down; the process exit code."""
    configure_logging(json_output=settings.json_output, level=settings.log_level)

    async def main() -> int:
        # Built inside the loop: grpc.aio objects bind to the running loop.
        return await LoomServer(settings).run()

    return asyncio.run(main())
