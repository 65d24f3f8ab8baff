"""``loom serve --num-shard 2`` as a real process tree: server -> engine (rank 0) -> rank 1.

One server per test (each ends it): GetModelInfo reports the shard count and a stream completes;
SIGTERM to the whole process group drains the stream and stops every rank; a rank killed in the
middle of a stream ends the server (health NOT_SERVING on the way, exit code 1) with a message
naming the rank, within seconds, and leaves no process behind.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from loom_client.v1 import generation_pb2 as pb

from .server_process import ServerProcess, engine_pid, start_server, stream_into

pytestmark = pytest.mark.e2e


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _rank_pids(server: ServerProcess) -> list[int]:
    engine = engine_pid(server.proc.pid)
    ranks = [c for c in _children(engine) if b"loom.worker.rank_process" in Path(f"/proc/{c}/cmdline").read_bytes()]
    return ranks


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.fixture
def sharded_server(tiny_llama_dir: Path, server_logs: Path, request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    server = start_server(tiny_llama_dir, server_logs, f"sharded-{request.node.name}", "--num-shard", "2",
                          "--max-batch-total-tokens", "4096", "--max-total-tokens", "512",
                          "--graceful-termination-timeout", "30", "--shard-step-timeout", "5", new_session=True)
    yield server
    if server.proc.poll() is None:
        os.killpg(server.proc.pid, signal.SIGKILL)
    server.stop(5)


def test_model_info_reports_the_shards_and_sigterm_drains_and_stops_every_rank(sharded_server: ServerProcess) -> None:
    server = sharded_server
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.num_shard == 2
    engine = engine_pid(server.proc.pid)
    ranks = _rank_pids(server)
    assert len(ranks) == 1
    results: list[object] = []
    started = threading.Event()
    thread = threading.Thread(target=stream_into, args=(server, 60, results, started))
    thread.start()
    assert started.wait(60)
    os.killpg(server.proc.pid, signal.SIGTERM)  # as a supervisor does: every process of the group
    thread.join(120)
    assert server.proc.wait(60) == 0
    assert isinstance(results[0], list)
    last = results[0][-1]  # drained, not cut
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and last.usage.generated_tokens == 60
    deadline = time.monotonic() + 15
    while (_alive(engine) or _alive(ranks[0])) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(engine) and not _alive(ranks[0])
    assert "rank stopped" in server.log_text()


def test_a_rank_killed_mid_stream_ends_the_server_naming_it(sharded_server: ServerProcess) -> None:
    server = sharded_server
    engine = engine_pid(server.proc.pid)
    [rank1] = _rank_pids(server)
    results: list[object] = []
    started = threading.Event()
    thread = threading.Thread(target=stream_into, args=(server, 400, results, started))
    thread.start()
    assert started.wait(60)
    killed = time.monotonic()
    os.kill(rank1, signal.SIGKILL)
    code = server.proc.wait(60)
    took = time.monotonic() - killed
    thread.join(30)
    assert code == 1
    assert took < 30, took
    log = server.log_text()
    assert f"tensor-parallel rank 1 (pid {rank1}) was killed by signal 9" in log
    assert "engine process is gone; stopping the server" in log
    assert isinstance(results[0], grpc.RpcError) and results[0].code() == grpc.StatusCode.UNAVAILABLE
    time.sleep(1)
    assert not _alive(engine) and not _alive(rank1)


def test_a_shard_count_the_model_does_not_split_into_is_refused_at_start(tmp_path: Path) -> None:
    """The embedded SmolLM2-135M (9 heads, 3 KV heads) on 2 shards: refused, every number named."""
    import subprocess
    import sys

    from .server_process import free_port, server_env

    proc = subprocess.run([sys.executable, "-m", "loom.cli", "serve", "--host", "127.0.0.1", "--port",
                           str(free_port()), "--prometheus-port", "0", "--num-shard", "2"],
                          capture_output=True, text=True, timeout=300, env=server_env())
    assert proc.returncode == 1
    assert ("--num-shard 2 cannot split this model: 9 attention heads are not divisible by 2; "
            "3 KV heads are not divisible by 2") in proc.stdout + proc.stderr
    assert "tensor-parallel ranks started" not in proc.stdout + proc.stderr  # refused before any rank
