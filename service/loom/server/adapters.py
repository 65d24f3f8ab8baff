"""The LoRA adapter RPCs' front-end half: checking LoadAdapter / UnloadAdapter requests, the
engine's replies as statuses, and adapters as protos (GetModelInfo, ListAdapters).

The engine owns the adapters (``loom.lora.manager``); the front end keeps the list from the
engine's last reply (``AsyncEngineClient.adapters``) to answer ListAdapters and GetModelInfo and
to refuse a request naming an adapter that is not loaded before it is queued (the engine checks
again: an unload may land in between).
"""

from __future__ import annotations

from typing import Protocol

import grpc

from loom.config import ADAPTER_NAME
from loom.engine.types import AdapterInfo, AdapterReply
from loom_client.v1 import generation_pb2 as pb

from .errors import FieldViolation, ServiceError, ValidationError, invalid

_STATUS = {name: getattr(grpc.StatusCode, name) for name in
           ("NOT_FOUND", "ALREADY_EXISTS", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "INTERNAL")}
_REASONS = {"NOT_FOUND": "ADAPTER_NOT_FOUND", "ALREADY_EXISTS": "ADAPTER_EXISTS",
            "RESOURCE_EXHAUSTED": "ADAPTER_SLOTS_FULL", "FAILED_PRECONDITION": "ADAPTER_UNAVAILABLE",
            "INTERNAL": "ADAPTER_LOAD_FAILED"}


class AdapterClient(Protocol):
    """What the adapter RPCs need of the engine client (``AsyncEngineClient``)."""

    adapters: tuple[AdapterInfo, ...]

    async def adapter_command(self, name: str, path: str | None) -> AdapterReply: ...


def adapter_proto(info: AdapterInfo) -> pb.Adapter:
    return pb.Adapter(adapter_id=info.name, path=info.path, rank=info.rank, alpha=info.alpha,
                      use_rslora=info.use_rslora, target_modules=list(info.target_modules))


def check_adapter_name(name: str, field: str = "adapter_id") -> list[FieldViolation]:
    if not ADAPTER_NAME.fullmatch(name):
        return [FieldViolation(field, "must be 1-128 letters, digits, '.', '_' or '-', starting with a letter or "
                                      f"digit, got {name[:140]!r}")]
    return []


def check_load(request: pb.LoadAdapterRequest) -> None:
    violations = check_adapter_name(request.adapter_id)
    if not request.path:
        violations.append(FieldViolation("path", "must name the adapter's directory on the server"))
    if violations:
        raise ValidationError(violations)


def check_unload(request: pb.UnloadAdapterRequest) -> None:
    if not request.adapter_id:
        raise invalid("adapter_id", "must name a loaded adapter")


def not_found(name: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.NOT_FOUND, f"adapter_id {name!r}: no such adapter is loaded",
                        "ADAPTER_NOT_FOUND")


def reply_error(reply: AdapterReply) -> ServiceError | None:
    """None for "OK"; else the status the engine named (INVALID_ARGUMENT naming the field)."""
    if reply.status == "OK":
        return None
    if reply.status == "INVALID_ARGUMENT":
        return ValidationError([FieldViolation(reply.field or "path", reply.message)], reason="INVALID_ADAPTER")
    code = _STATUS.get(reply.status, grpc.StatusCode.INTERNAL)
    return ServiceError(code, reply.message, _REASONS.get(reply.status, "ADAPTER_LOAD_FAILED"))
