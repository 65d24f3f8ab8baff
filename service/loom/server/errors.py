"""The errors a handler can end with, as rich gRPC statuses (google.rpc.Status with details).

Every failure a client sees carries an ErrorInfo (domain ``loom.v1`` and a reason a program can
switch on); INVALID_ARGUMENT adds a BadRequest naming each offending field, RESOURCE_EXHAUSTED a
RetryInfo. The servicer turns anything else into INTERNAL, so UNKNOWN never reaches a client.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

ERROR_DOMAIN = "loom.v1"
# A status travels in trailing metadata, which gRPC caps (8 KiB by default): a request with a
# hundred thousand bad stop token ids, or a megabyte-long chat role quoted back, must still get
# its INVALID_ARGUMENT rather than a transport error. The first violations say what is wrong.
MAX_VIOLATIONS = 8
MAX_DESCRIPTION_CHARS = 200
MAX_MESSAGE_CHARS = 1024


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class FieldViolation:
    field: str  # a path into the request message: "parameters.sampling.top_p", "chat.messages[1].role"
    description: str


class ServiceError(Exception):
    """A failure with its gRPC status code, a message for people and a reason for programs."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: str,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason
        self.retry_after_s = retry_after_s

    def details(self) -> list[object]:
        out: list[object] = [error_details_pb2.ErrorInfo(reason=self.reason, domain=ERROR_DOMAIN)]
        if self.retry_after_s is not None:
            delay = duration_pb2.Duration()
            delay.FromMilliseconds(int(self.retry_after_s * 1000))
            out.append(error_details_pb2.RetryInfo(retry_delay=delay))
        return out

    def to_grpc_status(self) -> grpc.Status:
        packed = []
        for detail in self.details():
            any_msg = any_pb2.Any()
            any_msg.Pack(detail)  # type: ignore[arg-type]
            packed.append(any_msg)
        status = status_pb2.Status(code=self.code.value[0], message=self.message, details=packed)
        return rpc_status.to_status(status)


class ValidationError(ServiceError):
    """INVALID_ARGUMENT: one or more fields of the request break a documented rule."""

    def __init__(self, violations: Iterable[FieldViolation]) -> None:
        found = list(violations)
        self.violations = [FieldViolation(_clip(v.field, MAX_DESCRIPTION_CHARS), _clip(v.description, MAX_DESCRIPTION_CHARS))
                           for v in found[:MAX_VIOLATIONS]]
        message = "; ".join(f"{v.field}: {v.description}" for v in self.violations) or "invalid request"
        if len(found) > MAX_VIOLATIONS:
            message += f" (and {len(found) - MAX_VIOLATIONS} more violations)"
        message = _clip(message, MAX_MESSAGE_CHARS)
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message, "INVALID_ARGUMENT")

    def details(self) -> list[object]:
        bad = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
                for v in self.violations
            ]
        )
        return [bad, *super().details()]


def invalid(field: str, description: str) -> ValidationError:
    return ValidationError([FieldViolation(field, description)])


def overloaded(message: str, retry_after_s: float = 1.0) -> ServiceError:
    """RESOURCE_EXHAUSTED with a RetryInfo: the wait queue is full."""
    return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, message, "OVERLOADED", retry_after_s=retry_after_s)


def unauthenticated(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.UNAUTHENTICATED, message, "UNAUTHENTICATED")


def unavailable(message: str, reason: str = "NOT_READY") -> ServiceError:
    return ServiceError(grpc.StatusCode.UNAVAILABLE, message, reason)


def failed_precondition(message: str, reason: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.FAILED_PRECONDITION, message, reason)


def internal(message: str, reason: str = "INTERNAL") -> ServiceError:
    return ServiceError(grpc.StatusCode.INTERNAL, message, reason)
