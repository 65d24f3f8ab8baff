"""The real server with asynchronous scheduling forced on (the CUDA default) on CPU: concurrent
streams with stop strings, n > 1, seeded sampling and a cancelled stream give exactly what the
synchronous server gives, and the cancelled request's KV blocks come back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from loom_client.v1 import generation_pb2 as pb
from loom_client.v1 import generation_pb2_grpc as pb_grpc

from .server_process import ServerProcess, start_server
from .test_generation_api import params
from .test_metrics import scrape, value


@pytest.fixture(scope="module")
def async_server(tiny_llama_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    server = start_server(tiny_llama_dir, server_logs, "tiny-async", "--max-total-tokens", "1024",
                          "--max-batch-total-tokens", "65536", "--max-input-tokens", "1000",
                          "--async-scheduling", "on")
    yield server
    server.stop()


def _requests() -> list[pb.GenerateStreamRequest]:
    reqs = []
    for i in range(16):
        kind = i % 4
        if kind == 0:
            p = params(20, ignore_eos=True)
        elif kind == 1:
            p = params(20, ignore_eos=True, stop_sequences=[" the", "e"])
        elif kind == 2:
            p = params(12, ignore_eos=True, do_sample=True, seed=40 + i, temperature=0.9)
            p.n, p.best_of = 2, 2
        else:
            p = params(15)  # may end on EOS
        reqs.append(pb.GenerateStreamRequest(request_id=f"a{i}", text=f"Request {i}: the topic is {i * 13}",
                                             parameters=p))
    return reqs


async def _run(address: str, reqs: list[pb.GenerateStreamRequest], cancel: str | None = None) -> dict[str, Any]:
    async def one(stub: Any, req: pb.GenerateStreamRequest) -> tuple[str, Any]:
        texts: dict[int, str] = {}
        reasons: dict[int, int] = {}
        call = stub.GenerateStream(req, timeout=120)
        async for msg in call:
            texts[msg.index] = texts.get(msg.index, "") + msg.text
            if msg.finish_reason:
                reasons[msg.index] = msg.finish_reason
            if req.request_id == cancel and sum(len(t) for t in texts.values()) > 0:
                call.cancel()
                break
        return req.request_id, (texts, reasons)

    async with grpc.aio.insecure_channel(address) as channel:
        stub: Any = pb_grpc.GenerationServiceStub(channel)
        return dict(await asyncio.gather(*(one(stub, r) for r in reqs)))


def test_async_server_equals_sync_server(async_server: ServerProcess, tiny_server: ServerProcess) -> None:
    reqs = _requests()
    sync = asyncio.run(_run(tiny_server.address, reqs))
    asyn = asyncio.run(_run(async_server.address, reqs))
    assert asyn == sync
    # A cancelled stream among the others: they still get their answers, and its blocks return.
    long = pb.GenerateStreamRequest(request_id="cancel-me", text="a long one", parameters=params(400, ignore_eos=True))
    again = asyncio.run(_run(async_server.address, [*reqs, long], cancel="cancel-me"))
    assert {k: v for k, v in again.items() if k != "cancel-me"} == sync
    deadline = time.monotonic() + 30
    while True:  # the engine's stats reach the metrics endpoint on its next poll
        s = scrape(async_server)
        if value(s, "loom_kv_cache_free_blocks") == value(s, "loom_kv_cache_blocks") > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert value(s, "loom_kv_cache_free_blocks") == value(s, "loom_kv_cache_blocks") > 0
