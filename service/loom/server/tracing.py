"""OpenTelemetry tracing: a server span per RPC, and queue / prefill / decode spans under it.

Off unless --otlp-endpoint is set. The packages are optional (the ``otel`` extra) and imported
only then; a missing one is a start-up error that names it.

The RPC spans come from opentelemetry-instrumentation-grpc's grpc.aio server interceptor. We
pass it to ``grpc.aio.server(interceptors=...)`` ourselves instead of calling
``GrpcAioInstrumentorServer().instrument()``: that one patches ``grpc.aio.server`` for the whole
process (so it must run before the server is built) and binds one tracer provider for good,
while an explicit interceptor serves exactly this server with this provider. It is the same
interceptor either way. Its stream wrapper iterates the handler's async generator, which is how
our streaming handlers are written (it cannot see messages sent with ``context.write``).
Health checks and reflection make no spans: a load balancer probing every second would drown
the traces.

The phase spans are made by :class:`loom.server.telemetry.RequestTelemetry` from timestamps once
each phase is over, with explicit start and end times. :class:`RequestSpans` keeps the RPC span's
context from the start of the handler, so they land under it even when a cancelled stream is
cleaned up in another task. The RPC span also gets ``loom.request_id``, and the trace id is bound
into structlog's context variables, so logs and traces of one request find each other.
"""

from __future__ import annotations

import time
from typing import Any

import grpc
import structlog

from loom.config import ConfigError

from .health import HEALTH_SERVICE

log = structlog.get_logger(__name__)

REFLECTION_PREFIX = "grpc.reflection."
Attributes = dict[str, str | int | float | bool]
_OTEL_HINT = "pip install 'loom-server[otel]'"


def epoch_offset_ns() -> int:
    """What to add to a time.monotonic() reading, in ns, to get OpenTelemetry's ns since the epoch."""
    return time.time_ns() - time.monotonic_ns()


def mono_to_ns(t: float, offset_ns: int | None = None) -> int:
    """A time.monotonic() reading as nanoseconds since the epoch.

    Pass one ``offset_ns`` for all the timestamps of a request: the same reading then always
    maps to the same instant, so back-to-back spans stay back to back (two separately computed
    offsets differ by the few ns between their clock reads).
    """
    return round(t * 1e9) + (epoch_offset_ns() if offset_ns is None else offset_ns)


class RequestSpans:
    """The spans of one generation request, children of the RPC span current at construction."""

    def __init__(self, tracer: Any, request_id: str) -> None:
        from opentelemetry import context as otel_context
        from opentelemetry import trace

        self._tracer = tracer
        self._parent = otel_context.get_current()
        self._rpc = trace.get_current_span(self._parent)
        self.attributes: Attributes = {"loom.request_id": request_id}
        self._rpc.set_attribute("loom.request_id", request_id)
        span_context = self._rpc.get_span_context()
        if span_context.is_valid:
            structlog.contextvars.bind_contextvars(trace_id=format(span_context.trace_id, "032x"))
        self._offset_ns = epoch_offset_ns()

    def phase(self, name: str, start: float, end: float, error: str | None = None,
              attributes: Attributes | None = None) -> None:
        """A finished phase span from ``start`` to ``end`` (time.monotonic() readings)."""
        self.end(self.start(name, start, attributes), end, error)

    def start(self, name: str, start: float, attributes: Attributes | None = None) -> Any:
        return self._tracer.start_span(name, context=self._parent, start_time=mono_to_ns(start, self._offset_ns),
                                       attributes={**self.attributes, **(attributes or {})})

    def end(self, span: Any, end: float, error: str | None = None, attributes: Attributes | None = None) -> None:
        from opentelemetry.trace import Status, StatusCode

        span.set_attributes(attributes or {})
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=mono_to_ns(end, self._offset_ns))

    def rpc(self, error: str | None = None, attributes: Attributes | None = None) -> None:
        """Attributes (and an error status) on the RPC span, unless it has ended already."""
        from opentelemetry.trace import Status, StatusCode

        if not self._rpc.is_recording():  # a cancelled stream's RPC span can end before clean-up
            return
        self._rpc.set_attributes(attributes or {})
        if error is not None:
            # The servicer answers with context.abort_with_status, which the instrumentation's
            # context wrapper does not see, so the RPC span would otherwise stay UNSET.
            self._rpc.set_status(Status(StatusCode.ERROR, error))


class Tracing:
    """A tracer provider, the RPC interceptor for it, and the spans of each request."""

    def __init__(self, provider: Any) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("loom.server")

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        """The RPC-span interceptor: it must be the first (outermost) one of the server."""
        from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters

        untraced = filters.any_of(filters.service_name(HEALTH_SERVICE), filters.service_prefix(REFLECTION_PREFIX))
        interceptor: grpc.aio.ServerInterceptor = aio_server_interceptor(
            tracer_provider=self.provider, filter_=filters.negate(untraced))
        return interceptor

    def request(self, request_id: str) -> RequestSpans:
        return RequestSpans(self.tracer, request_id)

    def shutdown(self) -> None:
        """Export what is buffered, then stop."""
        try:
            self.provider.shutdown()
        except Exception as exc:
            log.warning("trace exporter shutdown failed", error=repr(exc))


def setup_tracing(endpoint: str | None, service_name: str) -> Tracing | None:
    """Tracing that exports to the OTLP/gRPC collector at ``endpoint``; None when it is unset.

    Raises ConfigError, naming the package, when a needed one is not installed.
    """
    if not endpoint:
        return None
    try:
        import opentelemetry.instrumentation.grpc  # noqa: F401 - checked here, used by interceptor()
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise ConfigError(f"--otlp-endpoint needs opentelemetry-sdk and opentelemetry-instrumentation-grpc "
                          f"({exc}); {_OTEL_HINT}") from None
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise ConfigError(f"--otlp-endpoint needs the package opentelemetry-exporter-otlp-proto-grpc ({exc}); "
                          f"pip install opentelemetry-exporter-otlp-proto-grpc, or {_OTEL_HINT}") from None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    # http://host:4317 exports in plaintext, https:// over TLS (the exporter reads the scheme).
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    # Global as well, so spans other code makes with the OpenTelemetry API reach the same exporter.
    trace.set_tracer_provider(provider)
    log.info("tracing on", otlp_endpoint=endpoint, service_name=service_name)
    return Tracing(provider)
