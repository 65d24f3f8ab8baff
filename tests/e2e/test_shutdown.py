"""Shutdown as supervisors do it: SIGTERM to the whole process group, and the end of the grace period.

Many supervisors signal every process of a service (systemd's KillMode=control-group, ``timeout``,
``kill -- -PGID``, a shell's ``kill %1``). The engine process must leave the decision to the
front end, and the duplicate signal such a delivery brings must not cut the drain short.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from loom_client.v1 import generation_pb2 as pb

from .server_process import ServerProcess, engine_pid, start_server, stream_into

pytestmark = pytest.mark.e2e


def _final_pool_stats(log: str) -> tuple[int, int, int]:
    """(running, free_blocks, blocks) of the last 'engine stats at shutdown' line."""
    line = re.findall(r"engine stats at shutdown.*", log)[-1]
    values = {k: int(v) for k, v in re.findall(r"(running|free_blocks|blocks)=(\d+)", line)}
    return values["running"], values["free_blocks"], values["blocks"]


@pytest.fixture
def group_server(tiny_llama_dir: Path, server_logs: Path, request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    grace = request.param
    server = start_server(tiny_llama_dir, server_logs, f"group-{grace}", "--graceful-termination-timeout", grace,
                          "--max-concurrent-requests", "3", "--max-queue", "4", "--max-batch-total-tokens", "16384",
                          "--num-threads", "1", new_session=True)
    yield server
    if server.proc.poll() is None:
        os.killpg(server.proc.pid, signal.SIGKILL)
    server.stop(5)


@pytest.mark.parametrize("group_server", ["120"], indirect=True)
def test_sigterm_to_the_process_group_drains_in_flight_streams(group_server: ServerProcess) -> None:
    server = group_server
    engine = engine_pid(server.proc.pid)
    assert os.getpgid(engine) == server.proc.pid  # the engine is in the group the signal reaches
    results: list[object] = []
    started = [threading.Event() for _ in range(3)]
    threads = [threading.Thread(target=stream_into, args=(server, 1500, results, ev)) for ev in started]
    for t in threads:
        t.start()
    for ev in started:
        assert ev.wait(60)
    # What `timeout` does: the signal to the server, then to its whole group (a second copy; sent
    # a moment later here, or the kernel merges it with the first while that one is pending).
    os.kill(server.proc.pid, signal.SIGTERM)
    time.sleep(0.2)
    os.killpg(server.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while server.health_status() != "NOT_SERVING":
        assert time.monotonic() < deadline, "health did not turn NOT_SERVING on SIGTERM"
        time.sleep(0.05)
    with pytest.raises(grpc.RpcError) as info:
        server.stub.Generate(pb.GenerateRequest(text="Hello"), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert os.path.exists(f"/proc/{engine}"), "the engine died on the group's SIGTERM"
    for t in threads:
        t.join(240)
    assert len(results) == 3
    for messages in results:
        assert isinstance(messages, list), messages  # not an RpcError
        last = messages[-1]
        assert last.finish_reason == pb.FINISH_REASON_LENGTH and last.usage.generated_tokens == 1500
    assert server.proc.wait(120) == 0  # within the grace period: the drain ended when the streams did
    log = server.log_text()
    assert "engine process lost" not in log
    assert "signal ignored: the same stop delivered again" in log
    running, free, blocks = _final_pool_stats(log)
    assert running == 0 and free == blocks


@pytest.mark.parametrize("group_server", ["2"], indirect=True)
def test_requests_left_at_the_end_of_the_grace_period_get_unavailable_shutdown(
        group_server: ServerProcess) -> None:
    server = group_server
    results: list[object] = []
    started = [threading.Event() for _ in range(4)]
    # Three run (the server's limit) and one waits in the queue; none can finish within 2 s.
    threads = [threading.Thread(target=stream_into, args=(server, 4000, results, ev)) for ev in started]
    for t in threads[:3]:
        t.start()
    for ev in started[:3]:
        assert ev.wait(60)
    threads[3].start()
    time.sleep(0.5)  # the fourth is queued behind the three
    os.killpg(server.proc.pid, signal.SIGTERM)
    for t in threads:
        t.join(120)
    assert server.proc.wait(60) == 0
    assert len(results) == 4
    for result in results:
        assert isinstance(result, grpc.RpcError), result
        assert result.code() == grpc.StatusCode.UNAVAILABLE, result
        assert "grace period of 2 s (--graceful-termination-timeout) is over" in (result.details() or "")
        status = rpc_status.from_call(result)
        assert status is not None
        reasons = []
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reasons.append(info.reason)
        assert reasons == ["SHUTDOWN"]
    log = server.log_text()
    assert "request cancelled" not in log  # not reported as a client's cancel
    assert len(re.findall(r"request failed.*reason=SHUTDOWN", log)) == 4
    running, free, blocks = _final_pool_stats(log)
    assert running == 0 and free == blocks  # reported after the aborts were processed
