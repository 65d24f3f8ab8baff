"""Start-up, admission, cancellation, deadlines and the SIGTERM drain, on a server with one slot.

The server admits one request at a time (--max-concurrent-requests 1) and runs one sequence at a
time (--max-batch-size 1). A cancelled request that kept running in the engine would hold that
sequence slot for thousands of tokens, so a quick answer to the next request shows the cancel
reached the engine and freed the request's slot and KV blocks.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from loom_client.v1 import generation_pb2 as pb

from .server_process import ServerProcess, start_server

pytestmark = pytest.mark.e2e

LONG = pb.Parameters(stopping=pb.StoppingParameters(max_new_tokens=4000, ignore_eos=True))
QUICK = pb.Parameters(stopping=pb.StoppingParameters(max_new_tokens=2))
QUICK_ANSWER_S = 10.0  # the long request alone runs far longer than this


@pytest.fixture(scope="module")
def one_slot_server(tiny_llama_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    # --max-queue 0: a second request is refused at once instead of waiting (test_admission.py
    # covers the queue).
    server = start_server(tiny_llama_dir, server_logs, "one-slot", "--max-concurrent-requests", "1", "--max-queue", "0",
                          "--max-batch-size", "1", "--max-batch-total-tokens", "8192",
                          "--graceful-termination-timeout", "60", "--num-threads", "1")
    yield server
    server.stop()


def quick_request(server: ServerProcess) -> float:
    """Seconds until a short request is answered, retrying while the freed slot is released."""
    start = time.monotonic()
    while True:
        try:
            server.stub.Generate(pb.GenerateRequest(text="Hello", parameters=QUICK), timeout=60)
            return time.monotonic() - start
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() - start > 2:
                raise
            time.sleep(0.05)


def test_health_flips_from_not_serving_to_serving(one_slot_server: ServerProcess) -> None:
    seen = [s for s in one_slot_server.seen if s != "UNREACHABLE"]
    assert seen == ["NOT_SERVING", "SERVING"]
    assert one_slot_server.generate_while_loading == grpc.StatusCode.UNAVAILABLE
    assert one_slot_server.health_status("loom.v1.GenerationService") == "SERVING"


def test_over_the_limit_gets_resource_exhausted_with_retry_info(one_slot_server: ServerProcess) -> None:
    call = one_slot_server.stub.GenerateStream(pb.GenerateStreamRequest(text="Hi", parameters=LONG), timeout=120)
    next(call)  # admitted and generating
    try:
        with pytest.raises(grpc.RpcError) as info:
            one_slot_server.stub.Generate(pb.GenerateRequest(text="Hello", parameters=QUICK), timeout=30)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        status = rpc_status.from_call(info.value)
        assert status is not None
        retry = error_details_pb2.RetryInfo()
        assert any(d.Unpack(retry) for d in status.details if d.Is(retry.DESCRIPTOR))
        assert retry.retry_delay.ToMilliseconds() > 0
        # Health checks are not subject to the limit.
        assert one_slot_server.health_status() == "SERVING"
    finally:
        call.cancel()


def test_cancel_mid_stream_frees_the_slot(one_slot_server: ServerProcess) -> None:
    call = one_slot_server.stub.GenerateStream(
        pb.GenerateStreamRequest(request_id="to-cancel", text="Hi", parameters=LONG), timeout=120)
    next(call)
    next(call)
    call.cancel()
    assert quick_request(one_slot_server) < QUICK_ANSWER_S
    assert re.search(r"request cancelled.*request_id=to-cancel", one_slot_server.log_text())


def test_deadline_frees_the_slot(one_slot_server: ServerProcess) -> None:
    with pytest.raises(grpc.RpcError) as info:
        one_slot_server.stub.Generate(pb.GenerateRequest(request_id="too-slow", text="Hi", parameters=LONG), timeout=1.0)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert quick_request(one_slot_server) < QUICK_ANSWER_S


def test_second_server_cannot_share_the_port(one_slot_server: ServerProcess, tiny_llama_dir: Path,
                                             server_logs: Path) -> None:
    other = ServerProcess(tiny_llama_dir, server_logs / "same-port.log", "--port", str(one_slot_server.port))
    try:
        code = other.proc.wait(120)
    finally:
        other.stop(5)
    assert code != 0
    assert "cannot listen" in other.log_text()


def test_sigterm_drains_in_flight_streams(one_slot_server: ServerProcess) -> None:
    """Last in this module: it stops the server."""
    params = pb.Parameters(stopping=pb.StoppingParameters(max_new_tokens=400, ignore_eos=True))
    call = one_slot_server.stub.GenerateStream(pb.GenerateStreamRequest(text="Hi", parameters=params), timeout=120)
    first = next(call)
    one_slot_server.terminate()
    deadline = time.monotonic() + 10
    while one_slot_server.health_status() != "NOT_SERVING":
        assert time.monotonic() < deadline, "health did not turn NOT_SERVING on SIGTERM"
        time.sleep(0.05)
    with pytest.raises(grpc.RpcError) as info:
        one_slot_server.stub.Generate(pb.GenerateRequest(text="Hello", parameters=QUICK), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    rest = list(call)
    assert first.text + "".join(m.text for m in rest) != ""
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH and rest[-1].usage.generated_tokens == 400
    assert one_slot_server.proc.wait(60) == 0
    stats = re.search(r"engine stats at shutdown.*", one_slot_server.log_text())
    assert stats is not None
    free = re.search(r"free_blocks=(\d+)", stats.group(0))
    total = re.search(r" blocks=(\d+)", stats.group(0))
    assert free and total and free.group(1) == total.group(1), stats.group(0)
