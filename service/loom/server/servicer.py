"""loom.v1.GenerationService: the RPCs over the engine client (generation, tokenization, model
information, and LoRA adapters: ``adapters.py``).

Each generation handler: admission (UNAVAILABLE / RESOURCE_EXHAUSTED before any work), a request
id bound into the logs, validation, then the engine. Every failure is turned into a rich status
here, so no exception escapes as UNKNOWN. A client cancel, disconnect or deadline arrives as
CancelledError; it is let through, and closing the chunk stream on the way out aborts the engine
request, freeing its slot and KV blocks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from loom.engine.core_process import EngineDeadError, RequestEndedError
from loom.engine.types import EngineInfo
from loom.frontend.coalesce import coalesced
from loom.frontend.completion import EngineRequestError
from loom.frontend.generation import EngineClient, GenerationPlan, collect_completions, generate_chunks
from loom.frontend.tokenizer import Tokenizer
from loom.structured.checks import ConstraintChecker
from loom_client.v1 import generation_pb2 as pb
from loom_client.v1 import generation_pb2_grpc as pb_grpc

from .adapters import (
    AdapterClient,
    adapter_proto,
    check_load,
    check_unload,
    not_found,
    reply_error,
)
from .admission import Admission
from .errors import (
    FieldViolation,
    ServiceError,
    ValidationError,
    failed_precondition,
    internal,
    invalid,
    unavailable,
)
from .prompt_input import (
    check_chat,
    check_size,
    check_special_token_parsing,
    parses_special_tokens,
    render_chat,
)
from .responses import generate_response, stream_message
from .telemetry import RequestTelemetry, Telemetry
from .validation import RequestLimits, validate_generate

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Backend:
    """What the handlers need once the model is loaded."""

    engine: EngineClient
    tokenizer: Tokenizer
    limits: RequestLimits
    info: EngineInfo
    model_info: pb.GetModelInfoResponse
    constraints: ConstraintChecker | None = None  # structured output's checks (None: not served)


def to_service_error(exc: BaseException) -> ServiceError:
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, EngineRequestError):
        r = exc.rejection  # refused by the engine for the request's own sake (a grammar's compile)
        if r is not None and r.status == "INVALID_ARGUMENT":
            return ValidationError([FieldViolation(r.field, str(exc))], reason=r.reason)
        if r is not None and r.status == "FAILED_PRECONDITION":
            return failed_precondition(str(exc), r.reason)
        if r is not None and r.status == "NOT_FOUND":
            return ServiceError(grpc.StatusCode.NOT_FOUND, str(exc), r.reason)
        return internal(f"generation failed: {exc}", r.reason if r is not None else "GENERATION_FAILED")
    if isinstance(exc, RequestEndedError):  # the server's shutdown ended it, not the request's fault
        return unavailable(f"{exc}; retry on another replica", "SHUTDOWN")
    if isinstance(exc, EngineDeadError):
        # Not this request's fault, and this replica is about to stop: a client should retry.
        return unavailable(f"the engine stopped: {exc}; retry on another replica", "ENGINE_DEAD")
    log.error("unexpected error", error=repr(exc), exc_info=exc)
    return internal(f"internal error: {type(exc).__name__}: {exc}")


class GenerationService(pb_grpc.GenerationServiceServicer):
    def __init__(self, admission: Admission, telemetry: Telemetry | None = None) -> None:
        self.admission = admission
        self.telemetry = telemetry if telemetry is not None else Telemetry()
        self.backend: Backend | None = None
        self._engine_ids: set[str] = set()

    def attach(self, backend: Backend) -> None:
        self.backend = backend

    def _backend(self) -> Backend:
        if self.backend is None:
            raise unavailable("the server is still loading the model; retry shortly")
        return self.backend

    def _request_ids(self, given: str) -> tuple[str, str]:
        """(the id the client sees, a unique id for the engine, even if clients reuse ids)."""
        rid = given or uuid.uuid4().hex
        engine_id = rid if rid not in self._engine_ids else f"{rid}~{uuid.uuid4().hex[:8]}"
        return rid, engine_id

    @contextlib.contextmanager
    def _engine_id(self, engine_id: str) -> Any:
        self._engine_ids.add(engine_id)
        try:
            yield
        finally:
            self._engine_ids.discard(engine_id)

    def _plan(self, request: pb.GenerateRequest | pb.GenerateStreamRequest, rid: str, engine_id: str,
              streaming: bool, arrival: float) -> GenerationPlan:
        b = self._backend()
        plan = validate_generate(request, engine_id, b.tokenizer, b.limits, streaming, arrival, b.constraints)
        adapter = plan.engine_request.adapter_id
        if adapter and adapter not in {a.name for a in getattr(b.engine, "adapters", ())}:
            raise not_found(adapter)  # never served by the base model instead
        log.info("request admitted", prompt_tokens=len(plan.engine_request.prompt_token_ids),
                 max_new_tokens=plan.engine_request.stopping.max_new_tokens, n=plan.n, best_of=plan.best_of,
                 do_sample=plan.engine_request.sampling.do_sample, stream=streaming)
        return plan

    @contextlib.asynccontextmanager
    async def _admitted(self, request: pb.GenerateRequest | pb.GenerateStreamRequest, rid: str, engine_id: str,
                        streaming: bool, arrival: float, context: Any,
                        telemetry: RequestTelemetry) -> AsyncIterator[GenerationPlan]:
        """Overload check, validation, then a slot (waiting in the queue if need be) for the plan.

        Overload and draining are answered before any work; an invalid request fails before it
        waits, so it never takes a place in the queue.
        """
        self.admission.check()
        with self._engine_id(engine_id):
            plan = self._plan(request, rid, engine_id, streaming, arrival)
            telemetry.validated(plan)
            async with self.admission.slot(plan.engine_request.priority, context.time_remaining()):
                yield plan

    # -- RPCs -----------------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context: Any) -> pb.GenerateResponse:
        arrival = time.monotonic()
        rid, engine_id = self._request_ids(request.request_id)
        structlog.contextvars.bind_contextvars(request_id=rid, rpc="Generate")
        telemetry = self.telemetry.request(rid, arrival, context)
        try:
            async with self._admitted(request, rid, engine_id, False, arrival, context, telemetry) as plan:
                b = self._backend()
                engine = telemetry.observe(b.engine)
                async with contextlib.aclosing(generate_chunks(engine, b.tokenizer, plan)) as chunks:
                    result = await collect_completions(chunks, plan)
                response = generate_response(result, plan)
                response.request_id = rid
                log.info("request finished", generated_tokens=result.generated_tokens,
                         finish_reasons=[c.finish_reason.value if c.finish_reason else None
                                         for c in result.completions],
                         duration_ms=round((time.monotonic() - arrival) * 1000, 1))
                telemetry.succeeded(result.generated_tokens,
                                    [c.finish_reason.value for c in result.completions if c.finish_reason])
                return response
        except asyncio.CancelledError:
            telemetry.cancelled()
            log.info("request cancelled", reason="client cancel, disconnect or deadline",
                     duration_ms=round((time.monotonic() - arrival) * 1000, 1))
            raise
        except Exception as exc:
            error = to_service_error(exc)
        telemetry.failed(error.code, error.message, error.reason)
        self._log_failure(error)
        await context.abort_with_status(error.to_grpc_status())
        raise AssertionError("unreachable")  # abort_with_status raises

    async def GenerateStream(self, request: pb.GenerateStreamRequest, context: Any) -> AsyncIterator[pb.GenerateStreamResponse]:
        arrival = time.monotonic()
        rid, engine_id = self._request_ids(request.request_id)
        structlog.contextvars.bind_contextvars(request_id=rid, rpc="GenerateStream")
        telemetry = self.telemetry.request(rid, arrival, context)
        sent = 0
        try:
            async with self._admitted(request, rid, engine_id, True, arrival, context, telemetry) as plan:
                b = self._backend()
                generated = 0
                finish_reasons: list[str] = []
                engine = telemetry.observe(b.engine)
                async with contextlib.aclosing(coalesced(generate_chunks(engine, b.tokenizer, plan))) as batches:
                    async for batch in batches:
                        for chunk in batch:
                            msg = stream_message(chunk, plan)
                            msg.request_id = rid
                            if chunk.finish_reason is not None:
                                generated += chunk.generated_tokens
                                finish_reasons.append(chunk.finish_reason.value)
                            sent += 1
                            yield msg
                log.info("request finished", generated_tokens=generated, messages=sent,
                         duration_ms=round((time.monotonic() - arrival) * 1000, 1))
                telemetry.succeeded(generated, finish_reasons)
                return
        except (asyncio.CancelledError, GeneratorExit):
            # CancelledError while waiting for tokens; GeneratorExit when grpc closes this
            # generator between messages. Either way the stream closes and the engine aborts.
            telemetry.cancelled()
            log.info("request cancelled", reason="client cancel, disconnect or deadline", messages=sent,
                     duration_ms=round((time.monotonic() - arrival) * 1000, 1))
            raise
        except Exception as exc:
            error = to_service_error(exc)
        telemetry.failed(error.code, error.message, error.reason)
        self._log_failure(error, messages_sent=sent)
        await context.abort_with_status(error.to_grpc_status())

    async def Tokenize(self, request: pb.TokenizeRequest, context: Any) -> pb.TokenizeResponse:
        try:
            return self._tokenize(request)
        except Exception as exc:
            error = to_service_error(exc)
        await context.abort_with_status(error.to_grpc_status())
        raise AssertionError("unreachable")

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Any) -> pb.GetModelInfoResponse:
        try:
            b = self._backend()
            adapters = getattr(b.engine, "adapters", ())
            if not adapters:
                return b.model_info
            info = pb.GetModelInfoResponse()
            info.CopyFrom(b.model_info)
            info.adapters.extend(adapter_proto(a) for a in adapters)
            return info
        except Exception as exc:
            error = to_service_error(exc)
        await context.abort_with_status(error.to_grpc_status())
        raise AssertionError("unreachable")

    # -- LoRA adapters (loom.lora) -----------------------------------------------------------------
    def _adapter_client(self) -> AdapterClient:
        engine = self._backend().engine
        if not hasattr(engine, "adapter_command"):
            raise failed_precondition("this server's engine does not serve LoRA adapters", "ADAPTER_UNAVAILABLE")
        return engine  # type: ignore[return-value]

    async def _adapter_command(self, name: str, path: str | None) -> pb.Adapter:
        reply = await self._adapter_client().adapter_command(name, path)
        error = reply_error(reply)
        if error is not None:
            raise error
        assert reply.adapter is not None
        log.info("adapter loaded" if path is not None else "adapter unloaded", adapter=name,
                 path=reply.adapter.path, rank=reply.adapter.rank)
        return adapter_proto(reply.adapter)

    async def LoadAdapter(self, request: pb.LoadAdapterRequest, context: Any) -> pb.LoadAdapterResponse:
        try:
            check_load(request)
            return pb.LoadAdapterResponse(adapter=await self._adapter_command(request.adapter_id, request.path))
        except Exception as exc:
            error = to_service_error(exc)
        self._log_failure(error, rpc="LoadAdapter", adapter=request.adapter_id[:140])
        await context.abort_with_status(error.to_grpc_status())
        raise AssertionError("unreachable")

    async def UnloadAdapter(self, request: pb.UnloadAdapterRequest, context: Any) -> pb.UnloadAdapterResponse:
        try:
            check_unload(request)
            return pb.UnloadAdapterResponse(adapter=await self._adapter_command(request.adapter_id, None))
        except Exception as exc:
            error = to_service_error(exc)
        self._log_failure(error, rpc="UnloadAdapter", adapter=request.adapter_id[:140])
        await context.abort_with_status(error.to_grpc_status())
        raise AssertionError("unreachable")

    async def ListAdapters(self, request: pb.ListAdaptersRequest, context: Any) -> pb.ListAdaptersResponse:
        try:
            b = self._backend()
            return pb.ListAdaptersResponse(adapters=[adapter_proto(a) for a in getattr(b.engine, "adapters", ())],
                                           max_loras=b.info.max_loras, max_lora_rank=b.info.max_lora_rank)
        except Exception as exc:
            error = to_service_error(exc)
        await context.abort_with_status(error.to_grpc_status())
        raise AssertionError("unreachable")

    # -- helpers --------------------------------------------------------------------------------
    def _tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        tok = self._backend().tokenizer
        kind = request.WhichOneof("input")
        if kind is None:
            raise invalid("input", "set exactly one of text or chat")
        violations = check_size(request, self._backend().limits.max_input_chars)
        if not violations and kind == "chat":
            violations = check_chat(request.chat)
        violations += check_special_token_parsing(request)
        if violations:
            raise ValidationError(violations)
        rendered = ""
        if kind == "chat":
            rendered = render_chat(tok, request.chat)
            spans = tok.encode_with_offsets(rendered, add_special_tokens=False)
        else:
            add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            spans = tok.encode_with_offsets(request.text, add_special_tokens=add_special,
                                            parse_special_tokens=parses_special_tokens(request))
        resp = pb.TokenizeResponse(token_count=len(spans), rendered_text=rendered)
        for span in spans:
            t = resp.tokens.add(id=span.id, text=tok.token_text(span.id), special=tok.is_special(span.id))
            if request.return_offsets and span.start is not None and span.end is not None:
                t.offset.start, t.offset.end = span.start, span.end
        return resp

    def _log_failure(self, error: ServiceError, **extra: Any) -> None:
        level = "error" if error.code is grpc.StatusCode.INTERNAL else "info"
        getattr(log, level)("request failed", code=error.code.name, reason=error.reason, message=error.message, **extra)
