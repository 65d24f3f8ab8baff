"""Per-RPC counts and latency by method and status code, from a grpc.aio server interceptor.

py-grpc-prometheus only supports the synchronous server, hence this. The interceptor wraps the
handler itself, not the call: for a server stream the time runs until the stream ends (its last
message, its failure, or the client's cancel), not until the first message.

The status code of an RPC:

- the handler returned (or its stream ended): the code it set on the context, else OK;
- the handler aborted (``context.abort`` / ``abort_with_status`` raise after setting the code):
  the context's code;
- the handler was cancelled (asyncio.CancelledError, or GeneratorExit when gRPC closes a stream
  between messages): DEADLINE_EXCEEDED if the call's deadline has passed or is less than
  DEADLINE_SLACK_S away, else CANCELLED;
- any other exception: UNKNOWN (gRPC's own answer to an uncaught exception).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from typing import Any

import grpc
from prometheus_client import Counter, Histogram

Behavior = Callable[[Any, Any], Any]
# The server's deadline is the client's plus the request's travel time, so when a deadline
# passes the client usually cancels first, a few milliseconds before the server's own timer
# fires: a cancel this close to the deadline is taken as the deadline.
DEADLINE_SLACK_S = 0.1


def status_of(context: Any, default: grpc.StatusCode) -> grpc.StatusCode:
    """The code a handler set on its context, else ``default``."""
    try:
        code = context.code()
    except Exception:  # a context wrapper without code(): fall back
        return default
    return code if isinstance(code, grpc.StatusCode) else default


def cancel_status(context: Any) -> grpc.StatusCode:
    """CANCELLED, or DEADLINE_EXCEEDED when the cancel came from the call's deadline."""
    try:
        remaining = context.time_remaining()
    except Exception:
        remaining = None
    if remaining is not None and remaining < DEADLINE_SLACK_S:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED


def methods_of(*files: Any) -> frozenset[str]:
    """Full method names ("/package.Service/Method") of every service in these file descriptors."""
    return frozenset(f"/{service.full_name}/{method.name}"
                     for f in files for service in f.services_by_name.values() for method in service.methods)


class RpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    """``known_methods``: label any other method "other". Without an API key gRPC answers an
    unknown method itself (not counted), but the API-key interceptor answers every method, and
    a client could then mint a time series per made-up method name."""

    def __init__(self, requests: Counter, duration: Histogram, known_methods: Collection[str] | None = None) -> None:
        self._requests = requests
        self._duration = duration
        self._known = known_methods

    def _observe(self, method: str, code: grpc.StatusCode, started: float) -> None:
        elapsed = time.perf_counter() - started
        self._requests.labels(method=method, code=code.name).inc()
        self._duration.labels(method=method, code=code.name).observe(elapsed)

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: gRPC answers UNIMPLEMENTED; not a method of ours to count
            return None
        method = handler_call_details.method
        if self._known is not None and method not in self._known:
            method = "other"
        rd, rs = handler.request_deserializer, handler.response_serializer
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(self._wrap(handler.unary_unary, method), rd, rs)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(self._wrap(handler.unary_stream, method), rd, rs)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(self._wrap(handler.stream_unary, method), rd, rs)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(self._wrap(handler.stream_stream, method), rd, rs)
        return handler

    def _wrap(self, behavior: Behavior, method: str) -> Behavior:
        # An async generator handler yields its messages; anything else (a coroutine, which may
        # use context.write) is awaited. The wrapper must be of the same kind for gRPC.
        if inspect.isasyncgenfunction(behavior):
            return self._wrap_stream(behavior, method)
        return self._wrap_call(behavior, method)

    def _wrap_call(self, behavior: Behavior, method: str) -> Behavior:
        async def call(request: Any, context: Any) -> Any:
            started = time.perf_counter()
            code = grpc.StatusCode.UNKNOWN
            try:
                response = await behavior(request, context)
                code = status_of(context, grpc.StatusCode.OK)
                return response
            except asyncio.CancelledError:
                code = cancel_status(context)
                raise
            except BaseException:
                code = status_of(context, grpc.StatusCode.UNKNOWN)
                raise
            finally:
                self._observe(method, code, started)

        return call

    def _wrap_stream(self, behavior: Behavior, method: str) -> Behavior:
        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            started = time.perf_counter()
            code = grpc.StatusCode.UNKNOWN
            try:
                # Closed explicitly when this stream is: the handler's own clean-up (aborting
                # the engine request) then runs now, not whenever the generator is collected.
                async with contextlib.aclosing(behavior(request, context)) as messages:
                    async for message in messages:
                        yield message
                code = status_of(context, grpc.StatusCode.OK)
            except (asyncio.CancelledError, GeneratorExit):
                code = cancel_status(context)
                raise
            except BaseException:
                code = status_of(context, grpc.StatusCode.UNKNOWN)
                raise
            finally:
                self._observe(method, code, started)

        return stream
