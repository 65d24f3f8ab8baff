"""The Python client over two real servers on loopback with gRPC's round_robin policy: calls land on
both; a server that drains answers UNAVAILABLE before any output and the client retries those calls
on the other (nothing lost); a server killed mid-stream fails the streams that already had tokens
with UNAVAILABLE (reported, never replayed) while every call made afterwards is served."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loom_client import LoomClient
from loom_client.v1 import generation_pb2 as pb

from .server_process import ServerProcess, start_server

pytestmark = pytest.mark.e2e

GENERATE = "/loom.v1.GenerationService/Generate"
LONG = pb.Parameters(stopping=pb.StoppingParameters(max_new_tokens=4000, ignore_eos=True))


def metric(server: ServerProcess, sample_name: str, **labels: str) -> float:
    """The value of one sample of the server's /metrics (0 when it is not there yet)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == sample_name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def rpc_count(server: ServerProcess, method: str, code: str) -> float:
    return metric(server, "loom_grpc_requests_total", method=method, code=code)


def generation_requests(server: ServerProcess) -> float:
    return metric(server, "loom_request_count_total")


@pytest.fixture
def two_servers(tiny_llama_dir: Path, server_logs: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    servers: list[ServerProcess] = []
    try:
        for name in ("balanced-a", "balanced-b"):
            servers.append(start_server(tiny_llama_dir, server_logs, name, "--max-total-tokens", "4096",
                                        "--max-batch-total-tokens", "16384", "--graceful-termination-timeout", "60",
                                        new_session=True))
        yield servers[0], servers[1]
    finally:
        for server in servers:
            if server.proc.poll() is None:
                os.killpg(server.proc.pid, signal.SIGKILL)
            server.stop(10)


def warm_up(client: LoomClient, a: ServerProcess, b: ServerProcess) -> None:
    """Call until both servers have served one: round_robin uses a server once it is connected."""
    deadline = time.monotonic() + 30
    while min(rpc_count(s, GENERATE, "OK") for s in (a, b)) < 1:
        assert time.monotonic() < deadline, "round_robin never reached both servers"
        client.generate("warm-up", max_new_tokens=1)


def balanced(a: ServerProcess, b: ServerProcess, attempts: int = 3) -> LoomClient:
    return LoomClient(f"ipv4:{a.address},{b.address}", load_balancing="round_robin", max_attempts=attempts,
                      timeout=120)


def test_calls_land_on_both_and_a_draining_server_loses_none(two_servers: tuple[ServerProcess, ServerProcess]) -> None:
    a, b = two_servers
    with balanced(a, b) as client:
        warm_up(client, a, b)
        served = [rpc_count(s, GENERATE, "OK") for s in (a, b)]
        for i in range(8):
            assert client.generate(f"Hello {i}", max_new_tokens=2).completions[0].generated_tokens == 2
        now = [rpc_count(s, GENERATE, "OK") for s in (a, b)]
        assert now[0] - served[0] == now[1] - served[1] == 4, (served, now)  # in turn
        served = now

        # A long stream keeps A draining after SIGTERM; meanwhile A answers new calls UNAVAILABLE.
        long_call = a.stub.GenerateStream(pb.GenerateStreamRequest(
            text="Once upon a time", parameters=LONG), timeout=300)
        next(long_call)
        a.terminate()
        deadline = time.monotonic() + 30
        while a.health_status() != "NOT_SERVING" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert a.health_status() == "NOT_SERVING"
        replies = [client.generate(f"During the drain {i}", max_new_tokens=2) for i in range(8)]
        assert all(r.completions[0].generated_tokens == 2 for r in replies)
        refused = rpc_count(a, GENERATE, "UNAVAILABLE")
        assert refused >= 1, "round_robin never picked the draining server: the retry path was not exercised"
        assert rpc_count(b, GENERATE, "OK") == served[1] + 8  # every call of the drain was served by B
        long_call.cancel()
    assert a.proc.wait(60) == 0


def test_killed_server_fails_started_streams_and_later_calls_are_served(
    two_servers: tuple[ServerProcess, ServerProcess],
) -> None:
    a, b = two_servers
    with balanced(a, b) as client:
        # round_robin picks among connected servers: connect to both before the streams
        warm_up(client, a, b)
        # Two long streams: round_robin puts one on each server; both have sent a token.
        received = [generation_requests(s) for s in (a, b)]
        streams = [client.stream(f"Story {i}", max_new_tokens=1000, ignore_eos=True) for i in range(2)]
        for stream in streams:
            next(stream)
        assert [generation_requests(s) for s in (a, b)] == [received[0] + 1, received[1] + 1]
        os.killpg(a.proc.pid, signal.SIGKILL)
        outcomes: list[str] = []

        def drain(stream: Iterator[pb.GenerateStreamResponse]) -> None:
            try:
                for _ in stream:
                    pass
                outcomes.append("finished")
            except grpc.RpcError as exc:
                outcomes.append(exc.code().name)

        threads = [threading.Thread(target=drain, args=(s,)) for s in streams]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(180)
        # the stream on A had tokens: reported, not replayed on B; the one on B runs to its end
        assert sorted(outcomes) == ["UNAVAILABLE", "finished"], outcomes
        for i in range(6):
            assert client.generate(f"After the kill {i}", max_new_tokens=2).completions[0].generated_tokens == 2
