"""The wait queue on the real server: --max-concurrent-requests 1 --max-queue 2.

A long stream holds the only slot; what comes next waits in the queue, in priority order, until
it frees. Only a request that finds the queue full gets RESOURCE_EXHAUSTED (with a RetryInfo), and
a queued request whose deadline passes or whose client cancels leaves the queue at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from loom_client.v1 import generation_pb2 as pb
from loom_client.v1 import generation_pb2_grpc as pb_grpc

from .server_process import ServerProcess, start_server

pytestmark = pytest.mark.e2e

LONG = pb.Parameters(stopping=pb.StoppingParameters(max_new_tokens=4000, ignore_eos=True))
QUICK = pb.Parameters(stopping=pb.StoppingParameters(max_new_tokens=8, ignore_eos=True))
ARRIVE_S = 0.5  # enough for a loopback request to reach the queue


@pytest.fixture(scope="module")
def queue_server(tiny_llama_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    server = start_server(tiny_llama_dir, server_logs, "queue", "--max-concurrent-requests", "1",
                          "--max-queue", "2", "--max-batch-total-tokens", "8192")
    yield server
    server.stop()


def run(server: ServerProcess, body: Callable[[Any], Awaitable[None]]) -> None:
    async def main() -> None:
        async with grpc.aio.insecure_channel(server.address) as channel:
            await asyncio.wait_for(body(pb_grpc.GenerationServiceStub(channel)), 120)

    asyncio.run(main())


async def hold_the_slot(stub: Any) -> Any:
    call = stub.GenerateStream(pb.GenerateStreamRequest(request_id="holder", text="Hi", parameters=LONG), timeout=120)
    await call.read()  # a first message: it is in the engine
    return call


def quick(stub: Any, rid: str, timeout: float = 60, priority: int = 0) -> asyncio.Task[Any]:
    params = pb.Parameters()
    params.CopyFrom(QUICK)
    params.priority = priority
    return asyncio.ensure_future(stub.Generate(pb.GenerateRequest(request_id=rid, text=f"Hello {rid}",
                                                                  parameters=params), timeout=timeout))


def retry_info(err: grpc.aio.AioRpcError) -> error_details_pb2.RetryInfo | None:
    raw = dict(err.trailing_metadata() or ()).get("grpc-status-details-bin")
    if raw is None:
        return None
    for detail in status_pb2.Status.FromString(raw).details:
        info = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            return info
    return None


def test_queued_requests_wait_and_complete_and_a_full_queue_is_refused(queue_server: ServerProcess) -> None:
    async def body(stub: Any) -> None:
        holder = await hold_the_slot(stub)
        second, third = quick(stub, "second"), quick(stub, "third")
        await asyncio.sleep(ARRIVE_S)
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await quick(stub, "fourth")
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert time.monotonic() - started < 5, "a full queue must answer at once"
        assert "--max-queue" in (info.value.details() or "")
        retry = retry_info(info.value)
        assert retry is not None and retry.retry_delay.ToMilliseconds() > 0
        assert not second.done() and not third.done(), "queued requests must wait, not fail"
        assert queue_server.health_status() == "SERVING"  # health is not subject to admission
        holder.cancel()
        for reply in await asyncio.gather(second, third):
            assert reply.completions[0].generated_tokens == 8

    run(queue_server, body)


def test_queued_deadline_and_cancel_leave_the_queue_at_once(queue_server: ServerProcess) -> None:
    async def body(stub: Any) -> None:
        holder = await hold_the_slot(stub)
        expiring = quick(stub, "expiring", timeout=1.0)
        cancelled = quick(stub, "cancelled")
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await expiring
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 5
        cancelled.cancel()
        await asyncio.sleep(ARRIVE_S)
        # Both places are free again: two more requests queue (a third would be refused) ...
        rest = [quick(stub, "after-1"), quick(stub, "after-2")]
        await asyncio.sleep(ARRIVE_S)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await quick(stub, "refused")
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert not any(t.done() for t in rest)
        # ... and they complete once the slot frees: the expired one did not block them.
        holder.cancel()
        for reply in await asyncio.gather(*rest):
            assert reply.completions[0].generated_tokens == 8

    run(queue_server, body)


def test_queue_serves_lower_priority_values_first(queue_server: ServerProcess) -> None:
    async def body(stub: Any) -> None:
        holder = await hold_the_slot(stub)
        finished: list[str] = []

        async def tracked(rid: str, priority: int) -> None:
            await quick(stub, rid, priority=priority)
            finished.append(rid)

        low = asyncio.ensure_future(tracked("low", 10))
        await asyncio.sleep(ARRIVE_S)
        high = asyncio.ensure_future(tracked("high", -5))
        await asyncio.sleep(ARRIVE_S)
        holder.cancel()
        await asyncio.gather(low, high)
        assert finished == ["high", "low"]

    run(queue_server, body)
