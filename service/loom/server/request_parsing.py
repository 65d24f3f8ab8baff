"""A request whose bytes do not parse gets INVALID_ARGUMENT with Loom's message, not UNKNOWN.

grpc.aio parses a request with its handler's ``request_deserializer`` before the handler (and so
before anything an interceptor wrapped around it) runs. When the parse raises (a truncated or
garbled message, a string field that is not valid UTF-8, bytes of another message type) grpc
answers on its own: UNKNOWN, "Unexpected <class 'google.protobuf.message.DecodeError'>: ...",
and the per-RPC metrics never see the call.

This interceptor, the innermost one, gives every handler a parser that never raises: on failure
it hands the handler a :class:`MalformedRequest` instead of a message, and the handler, wrapped
here, answers INVALID_ARGUMENT (ErrorInfo reason MALFORMED_REQUEST) naming the RPC and the
parser's reason. The rejection happens inside the handler the outer interceptors wrapped, so the
RPC metrics count it and the trace span records it like any other failure. Servicers keep their
typed signatures: they only ever receive parsed messages.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from .errors import ServiceError

log = structlog.get_logger(__name__)

Behavior = Callable[[Any, Any], Any]
Deserializer = Callable[[bytes], Any]
MALFORMED_REQUEST = "MALFORMED_REQUEST"
# protobuf (upb): "Error parsing message with type 'loom.v1.GenerateRequest': Wire format was corrupt"
_PROTOBUF_PREFIX = re.compile(r"^Error parsing message(?: with type '[^']*')?:?\s*")
_MAX_REASON_CHARS = 200


@dataclass(frozen=True)
class MalformedRequest:
    """What a handler receives in place of a request whose bytes did not parse."""

    method: str  # "/loom.v1.GenerationService/Generate"
    message_type: str  # "loom.v1.GenerateRequest", or "" when the parser does not say
    reason: str  # the parser's own words, without exception class names

    def error(self) -> ServiceError:
        rpc = self.method.lstrip("/")
        expected = f" as a {self.message_type}" if self.message_type else ""
        return ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                            f"{rpc}: the request message could not be parsed{expected}: {self.reason}",
                            MALFORMED_REQUEST)


def _message_type(deserializer: Deserializer) -> str:
    # A generated stub passes ``SomeMessage.FromString``, bound to the message class.
    descriptor = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    return str(getattr(descriptor, "full_name", ""))


def parse_reason(exc: BaseException) -> str:
    """The parser's explanation, e.g. "string field had bad UTF-8", without class names."""
    reason = _PROTOBUF_PREFIX.sub("", str(exc)).strip() or "the bytes are not a valid protobuf encoding"
    reason = reason[0].lower() + reason[1:]
    return reason if len(reason) <= _MAX_REASON_CHARS else reason[: _MAX_REASON_CHARS - 3] + "..."


def lenient(deserializer: Deserializer, method: str) -> Deserializer:
    """``deserializer``, returning a :class:`MalformedRequest` where it would raise."""
    message_type = _message_type(deserializer)

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:
            return MalformedRequest(method, message_type, parse_reason(exc))

    return parse


async def reject(request: MalformedRequest, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    """End the call with the request's INVALID_ARGUMENT (raises, as ``abort_with_status`` does)."""
    error = request.error()
    log.info("request failed", rpc=request.method, code=error.code.name, reason=error.reason, message=error.message)
    await context.abort_with_status(error.to_grpc_status())


def _guard_unary_request(behavior: Behavior) -> Behavior:
    # Same kind as the wrapped behavior (async generator or coroutine): gRPC and the other
    # interceptors tell streaming handlers by it.
    if inspect.isasyncgenfunction(behavior):
        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            if isinstance(request, MalformedRequest):
                await reject(request, context)
            async with contextlib.aclosing(behavior(request, context)) as messages:
                async for message in messages:
                    yield message

        return stream

    async def call(request: Any, context: Any) -> Any:
        if isinstance(request, MalformedRequest):
            await reject(request, context)
        return await behavior(request, context)

    return call


async def _checked(requests: AsyncIterable[Any], context: Any) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, MalformedRequest):
            await reject(request, context)
        yield request


def _guard_request_stream(behavior: Behavior) -> Behavior:
    # Client streams (server reflection): each message is checked as the handler reads it.
    if inspect.isasyncgenfunction(behavior):
        async def stream(requests: Any, context: Any) -> AsyncIterator[Any]:
            async with contextlib.aclosing(behavior(_checked(requests, context), context)) as messages:
                async for message in messages:
                    yield message

        return stream

    async def call(requests: Any, context: Any) -> Any:
        return await behavior(_checked(requests, context), context)

    return call


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Must be the innermost interceptor, so that every other one wraps the rejection."""

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:  # unknown method, or raw bytes
            return handler
        parse = lenient(handler.request_deserializer, handler_call_details.method)
        rs = handler.response_serializer
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(_guard_unary_request(handler.unary_unary), parse, rs)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(_guard_unary_request(handler.unary_stream), parse, rs)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(_guard_request_stream(handler.stream_unary), parse, rs)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(_guard_request_stream(handler.stream_stream), parse, rs)
        return handler
