"""RpcMetricsInterceptor on a toy grpc.aio server: the code of every way an RPC can end.

Unary and server-streaming handlers, each: returning, aborting, raising, cancelled by the client,
and past the deadline. Also the engine collector's families and the /metrics endpoint.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from loom.engine.types import EngineStats
from loom.server.metrics import Metrics
from loom.server.metrics_http import start_metrics_server
from loom.server.rpc_metrics import RpcMetricsInterceptor


async def unary_ok(request: bytes, context: Any) -> bytes:
    return request


async def unary_abort(request: bytes, context: Any) -> bytes:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad")
    raise AssertionError("unreachable")


async def unary_raise(request: bytes, context: Any) -> bytes:
    raise ValueError("boom")


async def unary_slow(request: bytes, context: Any) -> bytes:
    await asyncio.sleep(10)
    return request


async def stream_ok(request: bytes, context: Any) -> AsyncIterator[bytes]:
    for _ in range(3):
        yield request


async def stream_abort(request: bytes, context: Any) -> AsyncIterator[bytes]:
    yield request
    await context.abort(grpc.StatusCode.INTERNAL, "failed mid-stream")


async def stream_forever(request: bytes, context: Any) -> AsyncIterator[bytes]:
    while True:
        yield request
        await asyncio.sleep(0.01)


HANDLERS: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
    "UnaryOk": grpc.unary_unary_rpc_method_handler(unary_ok),
    "UnaryAbort": grpc.unary_unary_rpc_method_handler(unary_abort),
    "UnaryRaise": grpc.unary_unary_rpc_method_handler(unary_raise),
    "UnarySlow": grpc.unary_unary_rpc_method_handler(unary_slow),
    "StreamOk": grpc.unary_stream_rpc_method_handler(stream_ok),
    "StreamAbort": grpc.unary_stream_rpc_method_handler(stream_abort),
    "StreamForever": grpc.unary_stream_rpc_method_handler(stream_forever),
}


def counts(metrics: Metrics) -> dict[tuple[str, str], float]:
    out = {}
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == "loom_grpc_requests_total":
                out[(s.labels["method"].rsplit("/", 1)[1], s.labels["code"])] = s.value
    return out


async def _exercise(metrics: Metrics) -> None:
    server = grpc.aio.server(interceptors=[RpcMetricsInterceptor(metrics.grpc_requests, metrics.grpc_request_duration)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Svc", HANDLERS)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            def unary(name: str) -> Any:
                return ch.unary_unary(f"/test.Svc/{name}")

            def stream(name: str) -> Any:
                return ch.unary_stream(f"/test.Svc/{name}")

            assert await unary("UnaryOk")(b"x", timeout=10) == b"x"
            for name, code in (("UnaryAbort", grpc.StatusCode.INVALID_ARGUMENT), ("UnaryRaise", grpc.StatusCode.UNKNOWN),
                               ("UnarySlow", grpc.StatusCode.DEADLINE_EXCEEDED)):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await unary(name)(b"x", timeout=0.3)
                assert info.value.code() == code
            assert [m async for m in stream("StreamOk")(b"y", timeout=10)] == [b"y"] * 3
            with pytest.raises(grpc.aio.AioRpcError):
                _ = [m async for m in stream("StreamAbort")(b"y", timeout=10)]
            call = stream("StreamForever")(b"z", timeout=30)
            await call.read()
            call.cancel()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                _ = [m async for m in stream("StreamForever")(b"z", timeout=0.3)]
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            for _ in range(200):  # the server records cancels on its side, a moment later
                if sum(counts(metrics).values()) >= 8:
                    break
                await asyncio.sleep(0.01)
    finally:
        await server.stop(0)


def test_every_ending_gets_its_code() -> None:
    metrics = Metrics()
    asyncio.run(_exercise(metrics))
    assert counts(metrics) == {
        ("UnaryOk", "OK"): 1,
        ("UnaryAbort", "INVALID_ARGUMENT"): 1,
        ("UnaryRaise", "UNKNOWN"): 1,
        ("UnarySlow", "DEADLINE_EXCEEDED"): 1,
        ("StreamOk", "OK"): 1,
        ("StreamAbort", "INTERNAL"): 1,
        ("StreamForever", "CANCELLED"): 1,
        ("StreamForever", "DEADLINE_EXCEEDED"): 1,
    }


def test_unknown_methods_share_one_label() -> None:
    metrics = Metrics()

    async def main() -> None:
        interceptor = RpcMetricsInterceptor(metrics.grpc_requests, metrics.grpc_request_duration,
                                            known_methods={"/test.Svc/UnaryOk"})
        server = grpc.aio.server(interceptors=[interceptor])
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Svc", HANDLERS)])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                unary: Any = ch.unary_unary("/test.Svc/UnaryOk")
                stream: Any = ch.unary_stream("/test.Svc/StreamOk")
                await unary(b"x", timeout=10)
                assert [m async for m in stream(b"x", timeout=10)]
        finally:
            await server.stop(0)

    asyncio.run(main())
    labels = {(s.labels["method"], s.labels["code"]) for f in metrics.registry.collect() for s in f.samples
              if s.name == "loom_grpc_requests_total"}
    assert labels == {("/test.Svc/UnaryOk", "OK"), ("other", "OK")}


def test_engine_families_from_the_snapshot() -> None:
    queued = [3]
    metrics = Metrics(admission_queued=lambda: queued[0])
    names = {s.name for f in metrics.registry.collect() for s in f.samples}
    assert "loom_queue_size" in names and "loom_kv_cache_blocks" not in names  # nothing before a snapshot
    metrics.engine.stats = EngineStats(num_running=2, num_waiting=1, num_free_blocks=30, num_blocks=40,
                                       num_preemptions=4, num_steps=99, num_prefill_chunks=5,
                                       prefix_cache_queries=64, prefix_cache_hits=16)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in metrics.registry.collect() for s in f.samples}
    assert samples[("loom_queue_size", (("queue", "admission"),))] == 3
    assert samples[("loom_queue_size", (("queue", "engine"),))] == 1
    assert samples[("loom_batch_current_size", ())] == 2
    assert samples[("loom_kv_cache_usage_ratio", ())] == pytest.approx(0.25)
    assert samples[("loom_kv_cache_free_blocks", ())] == 30
    assert samples[("loom_preemptions_total", ())] == 4
    assert samples[("loom_prefix_cache_hits_total", ())] == 16
    assert samples[("loom_prefix_cache_queries_total", ())] == 64
    assert samples[("loom_prefill_chunks_total", ())] == 5
    assert samples[("loom_engine_steps_total", ())] == 99
    assert samples[("loom_request_failure_total", (("err", "deadline"),))] == 0  # every reason from 0


def test_grammar_families_from_the_snapshot() -> None:
    from loom.structured.compiler_pool import COMPILE_TIME_BUCKETS

    metrics = Metrics()
    buckets = [0] * (len(COMPILE_TIME_BUCKETS) + 1)
    buckets[0], buckets[3], buckets[-1] = 2, 1, 1  # two under 1 ms, one under 10 ms, one past 30 s
    metrics.engine.stats = EngineStats(0, 0, 4, 4, 0, 0, grammar_cache_queries=7, grammar_cache_hits=3,
                                       grammar_compile_timeouts=1, grammar_compile_buckets=tuple(buckets),
                                       grammar_compile_seconds=31.5)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in metrics.registry.collect() for s in f.samples}
    assert samples[("loom_grammar_cache_queries_total", ())] == 7
    assert samples[("loom_grammar_cache_hits_total", ())] == 3
    assert samples[("loom_grammar_compile_timeouts_total", ())] == 1
    assert samples[("loom_grammar_compile_seconds_bucket", (("le", "0.001"),))] == 2
    assert samples[("loom_grammar_compile_seconds_bucket", (("le", "0.005"),))] == 2
    assert samples[("loom_grammar_compile_seconds_bucket", (("le", "0.01"),))] == 3  # cumulative
    assert samples[("loom_grammar_compile_seconds_bucket", (("le", "+Inf"),))] == 4
    assert samples[("loom_grammar_compile_seconds_count", ())] == 4
    assert samples[("loom_grammar_compile_seconds_sum", ())] == 31.5
    assert samples[("loom_constrained_requests_total", (("kind", "choice"),))] == 0  # every kind from 0


async def _http(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    data = await reader.read()
    writer.close()
    return data


def test_metrics_endpoint() -> None:
    metrics = Metrics()
    metrics.request_count.inc()
    scrapes = []

    async def before() -> None:
        scrapes.append(1)

    async def main() -> list[bytes]:
        server = await start_metrics_server("127.0.0.1", 0, metrics.registry, before)
        port = server.sockets[0].getsockname()[1]
        try:
            return [await _http(port, r) for r in (
                b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
                b"GET /nope HTTP/1.1\r\n\r\n",
                b"POST /metrics HTTP/1.1\r\n\r\n",
                b"HEAD /metrics HTTP/1.1\r\n\r\n",
                b"garbage\r\n\r\n",
            )]
        finally:
            server.close()
            await server.wait_closed()

    ok, missing, post, head, garbage = asyncio.run(main())
    assert ok.startswith(b"HTTP/1.1 200 OK") and b"\nloom_request_count_total 1.0\n" in ok
    assert missing.startswith(b"HTTP/1.1 404")
    assert post.startswith(b"HTTP/1.1 405")
    assert head.startswith(b"HTTP/1.1 200 OK") and head.endswith(b"\r\n\r\n")
    assert garbage == b""
    assert len(scrapes) == 2  # GET and HEAD refreshed the engine snapshot first
