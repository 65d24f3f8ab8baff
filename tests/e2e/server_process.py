"""A ``loom serve`` child process for end-to-end tests, and its health as seen from outside."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loom_client.v1 import generation_pb2 as pb
from loom_client.v1 import generation_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOM_") or k == "LOOM_CACHE_DIR"}
    # Works from a source checkout too: the same paths tests/conftest.py puts on sys.path.
    paths = [str(ROOT / "service"), str(ROOT / "clients" / "python" / "src")]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class ServerProcess:
    """One ``loom serve`` child process; records the health statuses seen while it started."""

    def __init__(self, model_dir: Path | None, log_path: Path, *extra: str,
                 credentials: grpc.ChannelCredentials | None = None, new_session: bool = False,
                 env: dict[str, str] | None = None) -> None:
        """``new_session``: the server leads a process group of its own (its engine in it), as
        under a supervisor that signals the whole group. ``env``: variables set for this server on
        top of :func:`server_env`'s."""
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        # Each test server gets a metrics port of its own: the default 9000 would clash between them.
        if "--prometheus-port" in extra:
            self.metrics_port = int(extra[extra.index("--prometheus-port") + 1])
        else:
            self.metrics_port = free_port()
            while self.metrics_port == self.port:
                self.metrics_port = free_port()
            extra = (*extra, "--prometheus-port", str(self.metrics_port))
        self.log_path = log_path
        args = [sys.executable, "-m", "loom.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port), *extra]
        if model_dir is not None:
            args += ["--model-id", str(model_dir)]
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**server_env(), **(env or {})}, start_new_session=new_session)
        # A TLS server is reached with ``credentials`` (its CA, and a client certificate for mTLS).
        self.channel = (grpc.insecure_channel(self.address) if credentials is None
                        else grpc.secure_channel(self.address, credentials))
        self.stub = pb_grpc.GenerationServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.seen: list[str] = []  # distinct health states in order, "UNREACHABLE" before listening
        self.generate_while_loading: grpc.StatusCode | None = None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health_status(self, service: str = "") -> str:
        try:
            resp = self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        except grpc.RpcError:
            return "UNREACHABLE"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_serving(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()[-4000:]}")
            status = self.health_status()
            if not self.seen or self.seen[-1] != status:
                self.seen.append(status)
            if status == "NOT_SERVING" and self.generate_while_loading is None:
                try:
                    self.stub.Generate(pb.GenerateRequest(text="hi"), timeout=5)
                except grpc.RpcError as exc:
                    self.generate_while_loading = exc.code()
            if status == "SERVING":
                return
            time.sleep(0.1)
        raise TimeoutError(f"server not SERVING after {timeout} s:\n{self.log_text()[-4000:]}")

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 60) -> int:
        self.terminate()
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.channel.close()
        self._log.close()
        return code


def start_server(model_dir: Path | None, log_dir: Path, name: str, *extra: str,
                 credentials: grpc.ChannelCredentials | None = None, new_session: bool = False,
                 env: dict[str, str] | None = None) -> ServerProcess:
    server = ServerProcess(model_dir, log_dir / f"{name}.log", *extra, credentials=credentials,
                           new_session=new_session, env=env)
    try:
        server.wait_serving()
    except BaseException:
        server.stop(5)
        raise
    return server


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"VmRSS:\s+(\d+) kB", status)
    assert match, status
    return int(match.group(1)) / 1024


def engine_pid(server_pid: int) -> int:
    """The engine process: the server's multiprocessing "spawn" child (not its resource tracker)."""
    children = []
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        children += (task / "children").read_text().split()
    engines = [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(engines) == 1, children
    return engines[0]


def stream_into(server: ServerProcess, tokens: int, results: list[object], started: threading.Event) -> None:
    """A stream of ``tokens`` tokens (EOS ignored) for a thread: appends the messages, or the
    RpcError that ended it, to ``results``; ``started`` is set at its first message (or error)."""
    params = pb.Parameters(stopping=pb.StoppingParameters(max_new_tokens=tokens, ignore_eos=True))
    try:
        call = server.stub.GenerateStream(pb.GenerateStreamRequest(text="Once upon a time", parameters=params),
                                          timeout=300)
        messages = []
        for msg in call:
            messages.append(msg)
            started.set()
        results.append(messages)
    except grpc.RpcError as exc:
        started.set()
        results.append(exc)
