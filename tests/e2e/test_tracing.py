"""Traces: a server built in-process with an in-memory span exporter.

One GenerateStream, one Generate, one invalid Generate and a few health checks, then the spans:
each generation RPC has a server span with loom.queue, loom.prefill and loom.decode as its
children, in that order in time; the invalid one has an error status and no phase spans; health
checks have no spans at all; and the request's logs carry the trace id.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loom.config import EngineConfig
from loom_client.v1 import generation_pb2 as pb
from loom_client.v1 import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.e2e

sdk_trace = pytest.importorskip("opentelemetry.sdk.trace")
in_memory = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter")
export = pytest.importorskip("opentelemetry.sdk.trace.export")

PHASES = ("loom.queue", "loom.prefill", "loom.decode")
Traced = tuple[list[Any], list[Any]]  # (finished spans, structlog entries)
GENERATE = "/loom.v1.GenerationService/Generate"
STREAM = "/loom.v1.GenerationService/GenerateStream"


def params(max_new_tokens: int) -> pb.Parameters:
    return pb.Parameters(stopping=pb.StoppingParameters(max_new_tokens=max_new_tokens, ignore_eos=True))


async def _traffic(server: Any) -> None:
    task = asyncio.create_task(server.run())
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{await _port(server)}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status != \
                    health_pb2.HealthCheckResponse.SERVING:
                assert not task.done(), "the server stopped during start-up"
                await asyncio.sleep(0.1)
            stub = pb_grpc.GenerationServiceStub(channel)
            messages = [m async for m in stub.GenerateStream(
                pb.GenerateStreamRequest(request_id="trace-stream", text="Once upon", parameters=params(5)), timeout=60)]
            assert messages[-1].usage.generated_tokens == 5
            resp = await stub.Generate(pb.GenerateRequest(request_id="trace-unary", text="Hello", parameters=params(4)),
                                       timeout=60)
            assert resp.usage.generated_tokens == 4
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Generate(pb.GenerateRequest(request_id="trace-invalid", text=""), timeout=60)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            for _ in range(3):
                await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
    finally:
        server.request_stop()
        assert await asyncio.wait_for(task, 60) == 0


async def _port(server: Any) -> int:
    for _ in range(600):
        if server.port:
            return int(server.port)
        await asyncio.sleep(0.01)
    raise TimeoutError("the server did not bind its port")


@pytest.fixture(scope="module")
def traced(tiny_llama_dir: Path) -> Traced:
    """(the finished spans, the log entries) of the traffic above."""
    from loom.server.app import LoomServer
    from loom.server.settings import ServerSettings
    from loom.server.tracing import Tracing

    exporter = in_memory.InMemorySpanExporter()
    provider = sdk_trace.TracerProvider()
    provider.add_span_processor(export.SimpleSpanProcessor(exporter))
    settings = ServerSettings(
        engine=EngineConfig(model_id=str(tiny_llama_dir), max_total_tokens=1024, max_batch_total_tokens=65536),
        host="127.0.0.1", port=0, prometheus_port=0, graceful_termination_timeout=5)

    async def main() -> None:
        await _traffic(LoomServer(settings, tracing=Tracing(provider)))

    with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        asyncio.run(main())
    return list(exporter.get_finished_spans()), logs


def _rpc_span(spans: list[Any], request_id: str) -> Any:
    found = [s for s in spans if s.kind.name == "SERVER" and s.attributes.get("loom.request_id") == request_id]
    assert len(found) == 1, [s.name for s in spans]
    return found[0]


def _children(spans: list[Any], parent: Any) -> dict[str, Any]:
    kids = [s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id]
    assert all(s.context.trace_id == parent.context.trace_id for s in kids)
    return {s.name: s for s in kids}


@pytest.mark.parametrize(("request_id", "method", "tokens"), [("trace-stream", STREAM, 5), ("trace-unary", GENERATE, 4)])
def test_phase_spans_are_children_of_the_rpc_span(traced: Traced, request_id: str,
                                                  method: str, tokens: int) -> None:
    spans, _ = traced
    rpc = _rpc_span(spans, request_id)
    assert rpc.name == method
    assert rpc.status.status_code.name == "UNSET"
    assert rpc.attributes["loom.generated_tokens"] == tokens
    assert rpc.attributes["loom.finish_reason"] == "length"
    kids = _children(spans, rpc)
    assert set(kids) == set(PHASES)
    queue, prefill, decode = (kids[name] for name in PHASES)
    # Back to back, inside the RPC span.
    assert rpc.start_time <= queue.start_time <= queue.end_time <= prefill.start_time
    assert prefill.start_time <= prefill.end_time <= decode.start_time <= decode.end_time <= rpc.end_time
    for span in kids.values():
        assert span.attributes["loom.request_id"] == request_id
    assert prefill.attributes["loom.prompt_tokens"] > 0
    assert decode.attributes["loom.generated_tokens"] == tokens
    assert decode.attributes["loom.finish_reason"] == "length"


def test_invalid_request_has_an_error_span_and_no_phases(traced: Traced) -> None:
    spans, _ = traced
    rpc = _rpc_span(spans, "trace-invalid")
    assert rpc.status.status_code.name == "ERROR"
    assert rpc.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert _children(spans, rpc) == {}


def test_health_checks_make_no_spans(traced: Traced) -> None:
    spans, _ = traced
    assert not [s.name for s in spans if "grpc.health" in s.name]
    assert {s.name for s in spans if s.kind.name == "SERVER"} == {GENERATE, STREAM}


def test_logs_carry_the_trace_id(traced: Traced) -> None:
    spans, logs = traced
    for request_id in ("trace-stream", "trace-unary"):
        trace_id = format(_rpc_span(spans, request_id).context.trace_id, "032x")
        finished = [e for e in logs if e.get("event") == "request finished" and e.get("request_id") == request_id]
        assert finished and all(e.get("trace_id") == trace_id for e in finished)
