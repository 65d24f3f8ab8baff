"""Failure isolation on the real server (--fault-injection): one request's fault fails it alone.

A request whose model step raises (inject-fault-*) or whose logits are NaN (inject-nan-*) ends
with INTERNAL and its message while requests batched with it complete unchanged, and health stays
SERVING. Only a dead engine process turns health NOT_SERVING (and stops the server). The soak test
(test_soak.py) repeats the first part a few hundred times under load.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from loom_client.v1 import generation_pb2 as pb
from loom_client.v1 import generation_pb2_grpc as pb_grpc

from .server_process import ServerProcess, engine_pid, start_server

pytestmark = pytest.mark.e2e

PARAMS = pb.Parameters(stopping=pb.StoppingParameters(max_new_tokens=24, ignore_eos=True))


@pytest.fixture(scope="module")
def fault_server(tiny_llama_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    server = start_server(tiny_llama_dir, server_logs, "faults", "--fault-injection", "--max-batch-total-tokens", "8192",
                          "--graceful-termination-timeout", "5")
    yield server
    server.stop()


def test_a_faulty_request_fails_alone(fault_server: ServerProcess) -> None:
    prompts = [f"Tell me about thread number {i}" for i in range(6)]
    alone = [fault_server.stub.Generate(pb.GenerateRequest(text=p, parameters=PARAMS), timeout=60).completions[0].text
             for p in prompts]

    async def one(stub: Any, rid: str, text: str, stream: bool) -> tuple[str, str]:
        try:
            if stream:
                out = ""
                async for msg in stub.GenerateStream(pb.GenerateStreamRequest(request_id=rid, text=text,
                                                                              parameters=PARAMS), timeout=60):
                    out += msg.text
                return "OK", out
            reply = await stub.Generate(pb.GenerateRequest(request_id=rid, text=text, parameters=PARAMS), timeout=60)
            return "OK", reply.completions[0].text
        except grpc.aio.AioRpcError as err:
            return err.code().name, err.details() or ""

    async def mixed() -> list[tuple[str, str]]:
        async with grpc.aio.insecure_channel(fault_server.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            calls = [one(stub, f"ok-{i}", p, stream=i % 2 == 0) for i, p in enumerate(prompts)]
            calls += [one(stub, "inject-fault-a", "boom", stream=False), one(stub, "inject-fault-b", "boom", stream=True),
                      one(stub, "inject-nan-a", "nan", stream=False), one(stub, "inject-nan-b", "nan", stream=True)]
            return await asyncio.gather(*calls)

    results = asyncio.run(mixed())
    for i, (code, text) in enumerate(results[:6]):
        assert code == "OK" and text == alone[i], f"request {i}: {code} {text!r}"
    for code, message in results[6:8]:
        assert code == "INTERNAL" and "injected failure" in message
    for code, message in results[8:]:
        assert code == "INTERNAL" and "non-finite logits" in message
    assert fault_server.health_status() == "SERVING"
    assert "step failed; re-running its sequences one by one" in fault_server.log_text()


def test_only_a_dead_engine_makes_health_not_serving(fault_server: ServerProcess) -> None:
    """Last in this module: it kills the engine, which stops the server."""
    assert fault_server.health_status() == "SERVING"
    long = pb.Parameters(stopping=pb.StoppingParameters(max_new_tokens=4000, ignore_eos=True))
    call = fault_server.stub.GenerateStream(pb.GenerateStreamRequest(text="Hi", parameters=long), timeout=60)
    next(call)
    os.kill(engine_pid(fault_server.proc.pid), signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as info:
        for _ in call:
            pass
    # Not the request's fault: a client should retry elsewhere.
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
    seen = set()
    deadline = time.monotonic() + 10
    while fault_server.proc.poll() is None and time.monotonic() < deadline:
        seen.add(fault_server.health_status())
        time.sleep(0.05)
    assert "SERVING" not in seen, seen
    assert fault_server.proc.wait(30) == 1
    assert "engine process is gone" in fault_server.log_text()
