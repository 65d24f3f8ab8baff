"""API-key authentication (--api-key / LOOM_API_KEY) as a grpc.aio server interceptor.

A client sends the key as call metadata ``authorization: Bearer <key>``; any other call ends with
UNAUTHENTICATED before its handler runs. The comparison is constant-time (``hmac.compare_digest``)
so response timing does not reveal how much of a guess was right.

The health service is exempt: load balancers and orchestrators probe it without credentials, and
it reveals nothing but serving status. Reflection is not exempt: it lists the whole API and is a
debugging tool, so ``buf curl`` / ``grpcurl`` must send the key like any other client
(``-H 'authorization: Bearer <key>'``). Unknown methods also answer UNAUTHENTICATED rather than
UNIMPLEMENTED, so an unauthenticated caller learns nothing about what the server offers.

Metadata over a plaintext port can be read by anyone on the path: use --api-key with TLS
(:mod:`loom.server.tls`) anywhere but loopback.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
import structlog

from .errors import unauthenticated

log = structlog.get_logger(__name__)

# Methods callable without a key: "/<package>.<Service>/" prefixes.
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)
AUTH_METADATA_KEY = "authorization"  # gRPC metadata keys are lower case
BEARER = "bearer"


def bearer_token(metadata: Sequence[tuple[str, Any]] | None) -> tuple[str | None, str]:
    """(the bearer token of ``metadata``, "") or (None, why there is none)."""
    values = [value for key, value in (metadata or ()) if key == AUTH_METADATA_KEY]
    if not values:
        return None, f"missing credentials: send the API key as metadata '{AUTH_METADATA_KEY}: Bearer <key>'"
    if len(values) > 1:
        return None, f"send exactly one '{AUTH_METADATA_KEY}' metadata entry"
    value = values[0]
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != BEARER or not token.strip():
        return None, f"the '{AUTH_METADATA_KEY}' metadata must be 'Bearer <key>'"
    return token.strip(), ""


def _deny(handler: grpc.RpcMethodHandler[Any, Any] | None, status: grpc.Status) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same kind as ``handler`` that answers ``status`` without reading the request."""

    async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort_with_status(status)

    async def streaming(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort_with_status(status)
        yield  # unreachable: makes this an async generator, as streaming responses expect

    if handler is None:
        return grpc.unary_unary_rpc_method_handler(unary)
    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **kwargs)
    return grpc.unary_unary_rpc_method_handler(unary, **kwargs)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_key: str) -> None:
        if not api_key:
            raise ValueError("an empty API key would let everyone in")
        self._key = api_key.encode()

    def check(self, metadata: Sequence[tuple[str, Any]] | None) -> str:
        """"" when ``metadata`` carries the key, else the message to answer with."""
        token, why = bearer_token(metadata)
        if token is None:
            return why
        # Both sides as bytes: compare_digest on str accepts ASCII only.
        if not hmac.compare_digest(token.encode(), self._key):
            return "invalid API key"
        return ""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method = handler_call_details.method
        if method.startswith(EXEMPT_PREFIXES):
            return await continuation(handler_call_details)
        problem = self.check(handler_call_details.invocation_metadata)
        handler = await continuation(handler_call_details)
        if not problem:
            return handler
        log.info("request refused", rpc=method, code="UNAUTHENTICATED", reason=problem)
        return _deny(handler, unauthenticated(problem).to_grpc_status())


def auth_interceptors(api_key: str | None) -> list[grpc.aio.ServerInterceptor]:
    """The interceptors --api-key asks for: none without a key."""
    return [ApiKeyInterceptor(api_key)] if api_key else []
