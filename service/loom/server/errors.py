"""The errors a handler can end with, as rich gRPC statuses (google.rpc.Status with details).

Every failure a client sees carries an ErrorInfo (domain ``loom.v1`` and a reason a program can
switch on); INVALID_ARGUMENT adds a BadRequest naming each offending field (see the budgets below),
RESOURCE_EXHAUSTED a RetryInfo. The servicer turns anything else into INTERNAL, so UNKNOWN never reaches a client.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

ERROR_DOMAIN = "loom.v1"
# A status travels in trailing metadata, which gRPC clients cap (C-core: 8 KiB, past which a
# response may be dropped, 16 KiB hard): a request with a hundred thousand bad stop token ids, or a
# megabyte-long chat role quoted back, must still get its INVALID_ARGUMENT rather than a transport
# error. So every violation is kept short, a repeated field reports its first bad element and how
# many there are (validation does that), and the whole stays within byte budgets: the BadRequest
# names every offending field of any request validation can see (22 at most, under 2 KiB), and
# only a status past MAX_VIOLATION_BYTES leaves the rest out, saying how many.
MAX_DESCRIPTION_CHARS = 200
MAX_VIOLATION_BYTES = 3072  # UTF-8 bytes of the fields and descriptions in one BadRequest
# The message is sent twice: percent-encoded in grpc-message (3 bytes for each byte that is not
# printable ASCII) and inside grpc-status-details-bin. Budgeted on the percent-encoded size.
MAX_MESSAGE_WIRE_BYTES = 1024


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _wire_bytes(char: str) -> int:
    """Bytes of ``char`` in a percent-encoded grpc-message header."""
    return sum(1 if 0x20 <= b <= 0x7E and b != 0x25 else 3 for b in char.encode())


def clip_message(text: str, limit: int = MAX_MESSAGE_WIRE_BYTES) -> str:
    """``text``, cut (ending in "...") so that its percent-encoded form takes at most ``limit`` bytes."""
    sizes = [_wire_bytes(c) for c in text]
    if sum(sizes) <= limit:
        return text
    kept, used = 0, 3  # room for "..."
    for size in sizes:
        if used + size > limit:
            break
        used += size
        kept += 1
    return text[:kept] + "..."


@dataclass(frozen=True)
class FieldViolation:
    field: str  # a path into the request message: "parameters.sampling.top_p", "chat.messages[1].role"
    description: str


def violation_bytes(v: FieldViolation) -> int:
    return len(v.field.encode()) + len(v.description.encode())


def in_all(count: int, what: str) -> str:
    """The end of a repeated field's violation, which names its first bad element only: " (12 ...
    in all)" when there are more. A violation per element could make a status too large to send."""
    return f" ({count} {what} in all)" if count > 1 else ""


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

    def __init__(self, violations: Iterable[FieldViolation], reason: str = "INVALID_ARGUMENT") -> None:
        found = [FieldViolation(_clip(v.field, MAX_DESCRIPTION_CHARS), _clip(v.description, MAX_DESCRIPTION_CHARS))
                 for v in violations]
        self.violations: list[FieldViolation] = []
        used = 0
        for v in found:
            used += violation_bytes(v)
            if used > MAX_VIOLATION_BYTES:
                break
            self.violations.append(v)
        self.omitted = len(found) - len(self.violations)
        listed = "; ".join(f"{v.field}: {v.description}" for v in self.violations) or "invalid request"
        more = f" (and {self.omitted} more violations, too many to list)" if self.omitted else ""
        message = clip_message(listed, MAX_MESSAGE_WIRE_BYTES - len(more)) + more
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message, reason)

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
