"""Build and run the grpc.aio server: listen first, load the model, serve, drain on SIGTERM.

The port is bound before the model loads so that health checks answer NOT_SERVING during
loading instead of connection errors. Shutdown (SIGTERM or SIGINT): health goes NOT_SERVING, new
generation requests get UNAVAILABLE, in-flight ones get up to --graceful-termination-timeout to
finish, then the server stops and the engine process with it. Requests still running when the
grace period ends get UNAVAILABLE (reason SHUTDOWN), so clients know to retry elsewhere.

A second signal stops at once, unless it arrives within a second of the first: supervisors
that signal a whole process group (``timeout`` signals the child and then its group; a group
kill may reach the server twice) deliver duplicates that must not cut a drain short. The
engine process ignores SIGTERM and SIGINT: stopping it is the front end's decision.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Sequence

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from loom.config import ConfigError
from loom.engine.core_process import AsyncEngineClient
from loom.logging_setup import configure_logging
from loom_client.v1 import generation_pb2 as pb
from loom_client.v1 import generation_pb2_grpc as pb_grpc

from .admission import Admission
from .auth import auth_interceptors
from .errors import unavailable
from .health import GENERATION_SERVICE, HEALTH_SERVICE, ServerHealth
from .loading import load_backend
from .metrics import EngineStatsPoller, Metrics
from .metrics_http import start_metrics_server
from .reflection import enable_reflection, v1_file_descriptor
from .request_parsing import MalformedRequestInterceptor
from .rpc_metrics import RpcMetricsInterceptor, methods_of
from .servicer import GenerationService
from .settings import ServerSettings
from .telemetry import Telemetry
from .tls import server_credentials
from .tracing import Tracing, setup_tracing

log = structlog.get_logger(__name__)

SERVER_OPTIONS = [
    # On by default in gRPC: a second server on the same port would silently share the traffic.
    ("grpc.so_reuseport", 0),
]
_ENGINE_CHECK_INTERVAL_S = 1.0
_SCRAPE_REFRESH_TIMEOUT_S = 0.25  # a scrape waits this long for a fresh engine snapshot, then serves the last
# A repeated signal closer than this to the first is the same stop delivered twice (to the
# process and to its group), not an operator asking to skip the drain.
DUPLICATE_SIGNAL_WINDOW_S = 1.0
_ENDED_REQUESTS_TIMEOUT_S = 5.0  # handlers answering UNAVAILABLE after the grace period


def build_server(service: GenerationService, health: ServerHealth, *,
                 interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                 max_request_bytes: int = 4 << 20) -> grpc.aio.Server:
    """``interceptors``: outermost first; a request that does not parse is rejected inside all of them."""
    # A larger message fails in gRPC itself with RESOURCE_EXHAUSTED, before it is even parsed.
    options = [*SERVER_OPTIONS, ("grpc.max_receive_message_length", max_request_bytes)]
    server = grpc.aio.server(interceptors=[*interceptors, MalformedRequestInterceptor()], options=options)
    pb_grpc.add_GenerationServiceServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    enable_reflection([GENERATION_SERVICE, HEALTH_SERVICE], server)
    return server


class LoomServer:
    def __init__(self, settings: ServerSettings, tracing: Tracing | None = None) -> None:
        """``tracing``: use this tracer provider (tests); unset, --otlp-endpoint decides (ConfigError
        when its packages are missing)."""
        self.settings = settings
        self.health = ServerHealth()
        self.admission = Admission(settings.max_concurrent_requests, settings.max_queue,
                                   max_queue_age_s=settings.engine.max_queue_age_s)
        self._owns_tracing = tracing is None
        self.tracing = tracing if tracing is not None else setup_tracing(settings.otlp_endpoint,
                                                                         settings.otlp_service_name)
        self.metrics = Metrics(admission_queued=lambda: self.admission.queued)
        self.stats_poller = EngineStatsPoller(self.metrics.engine)
        self.metrics_server: asyncio.Server | None = None
        self.service = GenerationService(self.admission, Telemetry(self.metrics, self.tracing))
        # Outermost first: the RPC span and the RPC metrics also see what authentication rejects.
        telemetry_interceptors: list[grpc.aio.ServerInterceptor] = [] if self.tracing is None else [
            self.tracing.interceptor()]
        telemetry_interceptors.append(RpcMetricsInterceptor(
            self.metrics.grpc_requests, self.metrics.grpc_request_duration,
            known_methods=methods_of(pb.DESCRIPTOR, health_pb2.DESCRIPTOR, reflection_pb2.DESCRIPTOR,
                                    v1_file_descriptor())))
        self.server = build_server(self.service, self.health,
                                   interceptors=[*telemetry_interceptors, *auth_interceptors(settings.api_key)],
                                   max_request_bytes=settings.max_request_bytes)
        self.engine: AsyncEngineClient | None = None
        self.port = 0
        self._stop = asyncio.Event()
        self._first_signal_at: float | None = None
        self._stopping_now = False
        self._exit_code = 0

    def request_stop(self, signum: int | None = None) -> None:
        name = signal.Signals(signum).name if signum else None
        now = time.monotonic()
        if self._first_signal_at is None:
            self._first_signal_at = now
            log.info("shutdown requested", signal=name)
            self._stop.set()
        elif now - self._first_signal_at < DUPLICATE_SIGNAL_WINDOW_S:
            log.info("signal ignored: the same stop delivered again (e.g. to the process group)", signal=name)
        elif not self._stopping_now:  # a second, deliberate signal: do not wait for in-flight requests
            self._stopping_now = True
            log.warning("second shutdown signal: stopping without waiting for requests in flight", signal=name)
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
        if s.prometheus_port:
            try:
                self.metrics_server = await start_metrics_server(
                    s.host, s.prometheus_port, self.metrics.registry,
                    lambda: self.stats_poller.refresh(_SCRAPE_REFRESH_TIMEOUT_S))
            except OSError as exc:
                log.error("cannot listen for metrics", host=s.host, prometheus_port=s.prometheus_port, error=str(exc))
                return 1
            log.info("metrics at /metrics", host=s.host, prometheus_port=s.prometheus_port)
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
            # A model the configuration cannot serve (a ConfigError, e.g. a quantized tensor that
            # contradicts its config) exits 2 like the checks before loading; a crash exits 1.
            self._exit_code = 2 if isinstance(failure, ConfigError) else 1
            self._stop.set()
        else:
            await self.health.serving()
            self.admission.ready = True
            log.info("serving", port=self.port)
            watchdog = asyncio.create_task(self._watch_engine())
            stats_poller = asyncio.create_task(self.stats_poller.run())
            await self._stop.wait()
            watchdog.cancel()
            stats_poller.cancel()
        stop_wait.cancel()
        await self._shutdown()
        return self._exit_code

    def _listen(self) -> int:
        credentials = server_credentials(self.settings.tls)
        if credentials is None:
            return self.server.add_insecure_port(self.settings.address)
        return self.server.add_secure_port(self.settings.address, credentials)

    async def _load(self) -> None:
        self.engine = AsyncEngineClient(self.settings.engine, log_json=self.settings.json_output,
                                        log_level=self.settings.log_level)
        backend = await load_backend(self.settings, self.engine)
        self.service.attach(backend)
        self.stats_poller.attach(self.engine, backend.info)

    async def _watch_engine(self) -> None:
        assert self.engine is not None
        while self.engine.is_alive():
            # Woken at once when the engine's pipe breaks; the poll catches a silent death too.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.engine.died.wait(), _ENGINE_CHECK_INTERVAL_S)
        await self.health.failed()  # NOT_SERVING now: this replica cannot serve any more
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
            await self._end_requests(grace)
        # Anything still open now (a stream the client stopped reading) is cancelled.
        await self.server.stop(0.5)
        if self.engine is not None:
            await self._log_engine_stats()
            await self.stats_poller.stop()
            await self.engine.shutdown()
        if self.metrics_server is not None:  # scrapable until here: the drain shows in the metrics
            self.metrics_server.close()
        if self.tracing is not None and self._owns_tracing:
            # Flushes the spans still buffered; the exporter may block on the network.
            await asyncio.get_running_loop().run_in_executor(None, self.tracing.shutdown)
        log.info("stopped")

    async def _end_requests(self, grace: float) -> None:
        """The grace period is over: requests still queued or running end with UNAVAILABLE
        (reason SHUTDOWN) rather than a cancel, and their KV blocks are freed before the last
        look at the pool."""
        if self._exit_code != 0:
            reason = "the server is stopping because its engine failed"
        else:
            reason = (f"the server is shutting down and its grace period of {grace:g} s "
                      "(--graceful-termination-timeout) is over")
        queued = self.admission.close(unavailable(f"{reason}; retry on another replica", "SHUTDOWN"))
        running = self.engine.end_all(reason) if self.engine is not None and self.engine.is_alive() else 0
        log.warning("ending requests still in flight", reason=reason, running=running, queued=queued)
        if not await self.admission.wait_idle(_ENDED_REQUESTS_TIMEOUT_S):
            log.warning("requests did not end in time; cancelling them", in_flight=self.admission.in_flight)

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
        try:
            server = LoomServer(settings)
        except ConfigError as exc:  # e.g. --otlp-endpoint without the OpenTelemetry packages
            log.error("cannot start", error=str(exc))
            return 2
        return await server.run()

    return asyncio.run(main())
