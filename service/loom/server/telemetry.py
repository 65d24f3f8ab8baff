"""What one generation request records: its metrics and, with tracing on, its phase spans.

The handler makes a :class:`RequestTelemetry` on arrival, tells it when validation is done,
routes the engine's outputs through :meth:`RequestTelemetry.observe`, and ends it exactly once:
succeeded, failed or cancelled. Timestamps are ``time.monotonic()`` readings; the engine's
``first_scheduled_time`` is one too (CLOCK_MONOTONIC is system-wide, so the two processes agree).

The phases of a request, and what is measured between them::

    arrival --validation--> validated --queue--> first scheduled --prefill--> first token --decode--> last token
    |<------------------------------------------ request_duration ------------------------------------------>|
    |<------------------------- time_to_first_token ------------------------>|
                                                  |<----------------- inference_duration ------------------->|

- validation: parsing, tokenizing and checking the request (a failed one is observed too).
- queue: from the end of validation until a step of the engine first runs the request: the
  admission wait queue plus the engine's waiting list. A request preempted later and recomputed
  does not queue again in this sense; preemptions have their own counter.
- prefill: from that first step to the first token reaching the front end. With chunked prefill
  it spans every chunk of the prompt; it includes one step's wait for the front end to read.
- decode: from the first token to the last one, as the front end received them.
- time to first token: arrival to the first token (what a client waits, less the network).
- inter-token latency: the gap between consecutive outputs of one completion divided over the
  tokens of the later one (one per step without speculation). A completion's first output
  has no gap, so the histogram counts a completion's tokens minus those of its first output.
- mean time per token: decode time over the longest completion's tokens after the first (the
  TPOT of vLLM's benchmarks), for successful requests of two tokens or more.

A request ends in exactly one of loom_request_success or loom_request_failure{err}, so
``loom_request_count == loom_request_success + sum(loom_request_failure)`` once none is in flight.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from loom.engine.types import EngineOutput, EngineRequest
from loom.frontend.generation import EngineClient, GenerationPlan

from .metrics import Metrics
from .rpc_metrics import cancel_status
from .tracing import Attributes, RequestSpans, Tracing

# Status code of a failed request -> loom_request_failure's err label; anything else: generation.
_FAILURE_KIND = {
    grpc.StatusCode.INVALID_ARGUMENT: "validation",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "overloaded",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.CANCELLED: "cancelled",
    grpc.StatusCode.DEADLINE_EXCEEDED: "deadline",
}


# Reasons (google.rpc.ErrorInfo) that name a more precise kind than their status code.
_REASON_KIND = {"SHUTDOWN": "shutdown"}


def failure_kind(code: grpc.StatusCode, reason: str = "") -> str:
    return _REASON_KIND.get(reason) or _FAILURE_KIND.get(code, "generation")


class Telemetry:
    """The server's metrics and (optional) tracing; one :class:`RequestTelemetry` per request."""

    def __init__(self, metrics: Metrics | None = None, tracing: Tracing | None = None) -> None:
        self.metrics = metrics if metrics is not None else Metrics()
        self.tracing = tracing

    def request(self, request_id: str, arrival: float, context: Any) -> RequestTelemetry:
        return RequestTelemetry(self.metrics, self.tracing, request_id, arrival, context)


class RequestTelemetry:
    def __init__(self, metrics: Metrics, tracing: Tracing | None, request_id: str, arrival: float,
                 context: Any) -> None:
        self._m = metrics
        self._context = context
        self.arrival = arrival
        self.validated_at: float | None = None
        self.first_scheduled: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self._last_output: dict[int, float] = {}  # completion index -> when its last output came
        self._tokens: dict[int, int] = {}  # completion index -> tokens so far
        self._ended = False
        self._spans: RequestSpans | None = tracing.request(request_id) if tracing is not None else None
        self._decode_span: Any = None
        metrics.request_count.inc()

    # -- the request's progress ---------------------------------------------------------------
    def validated(self, plan: GenerationPlan) -> None:
        now = time.monotonic()
        self.validated_at = now
        req = plan.engine_request
        self.prompt_tokens = len(req.prompt_token_ids)
        self._m.request_validation_duration.observe(now - self.arrival)
        self._m.request_input_length.observe(self.prompt_tokens)
        self._m.request_max_new_tokens.observe(req.stopping.max_new_tokens)
        constraint = req.sampling.constraint
        if constraint is not None:  # its field names the kind: parameters.constraint.<kind>
            self._m.constrained_requests.labels(kind=constraint.field.rsplit(".", 1)[-1]).inc()
        if req.adapter_id:
            self._m.adapter_requests.labels(adapter=req.adapter_id).inc()

    def observe(self, engine: EngineClient) -> EngineClient:
        """``engine`` with every output of this request seen by :meth:`output` on its way."""
        return _ObservedEngine(engine, self)

    def output(self, out: EngineOutput) -> None:
        now = time.monotonic()
        if self.first_scheduled is None and out.first_scheduled_time is not None:
            self.first_scheduled = out.first_scheduled_time
            queued_from = self._queued_from()
            self._m.request_queue_duration.observe(max(0.0, self.first_scheduled - queued_from))
            if self._spans is not None:
                self._spans.phase("loom.queue", queued_from, max(queued_from, self.first_scheduled))
        self.cached_prompt_tokens = max(self.cached_prompt_tokens, out.num_cached_tokens)
        if out.num_draft_tokens:
            self._m.speculative_draft_tokens.inc(out.num_draft_tokens)
            self._m.speculative_accepted_tokens.inc(out.num_accepted_draft_tokens)
            self._m.speculative_tokens_per_step.observe(len(out.token_ids))
        n = len(out.token_ids)
        if n == 0:
            return
        if self.first_token is None:
            self.first_token = now
            self._m.time_to_first_token.observe(now - self.arrival)
            if self._spans is not None:
                self._spans.phase("loom.prefill", self._prefill_from(now), now, attributes=self._prompt_attributes())
                self._decode_span = self._spans.start("loom.decode", now)
        last = self._last_output.get(out.index)
        if last is not None:
            gap = (now - last) / n
            for _ in range(n):
                self._m.inter_token_latency.observe(gap)
        self._last_output[out.index] = now
        self._tokens[out.index] = self._tokens.get(out.index, 0) + n
        self.last_token = now

    # -- the end, exactly once ----------------------------------------------------------------
    def succeeded(self, generated_tokens: int, finish_reasons: Sequence[str]) -> None:
        if self._ended:
            return
        self._ended = True
        now = time.monotonic()
        m = self._m
        m.request_success.inc()
        m.request_duration.observe(now - self.arrival)
        m.request_generated_tokens.observe(generated_tokens)
        if self.first_scheduled is not None and self.last_token is not None:
            m.request_inference_duration.observe(max(0.0, self.last_token - self.first_scheduled))
        longest = max(self._tokens.values(), default=0)
        if longest > 1 and self.first_token is not None and self.last_token is not None:
            m.request_mean_time_per_token_duration.observe((self.last_token - self.first_token) / (longest - 1))
        if self._spans is not None:
            outcome: Attributes = {"loom.generated_tokens": generated_tokens,
                                   "loom.finish_reason": ",".join(finish_reasons)}
            if self._decode_span is not None:
                self._spans.end(self._decode_span, self.last_token or now, attributes=outcome)
            self._spans.rpc(attributes={**self._prompt_attributes(), **outcome})

    def failed(self, code: grpc.StatusCode, message: str = "", reason: str = "") -> None:
        """``reason``: the error's google.rpc.ErrorInfo reason (SHUTDOWN counts as err="shutdown")."""
        if self._ended:
            return
        self._ended = True
        kind = failure_kind(code, reason)
        self._m.request_failure.labels(err=kind).inc()
        if self._spans is not None:
            error = f"{code.name}: {message}" if message else code.name
            self._end_open_phase(time.monotonic(), error, kind)
            # rpc.grpc.status_code too: the instrumentation sets it only for aborts it can see.
            self._spans.rpc(error, {**self._prompt_attributes(), "rpc.grpc.status_code": code.value[0],
                                    "loom.generated_tokens": sum(self._tokens.values()), "loom.outcome": kind})

    def cancelled(self) -> None:
        """The client cancelled, went away, or its deadline passed (gRPC cancelled the handler)."""
        self.failed(cancel_status(self._context))

    # -- helpers ------------------------------------------------------------------------------
    def _queued_from(self) -> float:
        return self.validated_at if self.validated_at is not None else self.arrival

    def _prefill_from(self, now: float) -> float:
        start = self.first_scheduled if self.first_scheduled is not None else self._queued_from()
        return min(start, now)

    def _prompt_attributes(self) -> Attributes:
        return {"loom.prompt_tokens": self.prompt_tokens, "loom.cached_prompt_tokens": self.cached_prompt_tokens}

    def _end_open_phase(self, now: float, error: str, kind: str) -> None:
        """Close the phase a failed or cancelled request was in, marked with the error."""
        assert self._spans is not None
        if self.validated_at is None:
            return  # it never got past validation: the RPC span says it all
        if self.first_scheduled is None:
            self._spans.phase("loom.queue", self.validated_at, now, error, {"loom.outcome": kind})
        elif self.first_token is None:
            self._spans.phase("loom.prefill", self.first_scheduled, max(now, self.first_scheduled), error,
                              {**self._prompt_attributes(), "loom.outcome": kind})
        elif self._decode_span is not None:
            self._spans.end(self._decode_span, now, error,
                            {"loom.generated_tokens": sum(self._tokens.values()), "loom.outcome": kind})


class _ObservedEngine:
    """An engine client whose outputs for one request pass through :meth:`RequestTelemetry.output`."""

    def __init__(self, engine: EngineClient, telemetry: RequestTelemetry) -> None:
        self._engine = engine
        self._telemetry = telemetry

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        outputs = self._engine.generate(request)
        try:
            async for out in outputs:
                self._telemetry.output(out)
                yield out
        finally:
            # Closing the engine's stream now is what aborts the request in the engine.
            aclose = getattr(outputs, "aclose", None)
            if aclose is not None:
                await aclose()
