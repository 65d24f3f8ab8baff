"""W3 serving: a load generator against ``loom serve`` over gRPC, and the same load in process.

The server is a child process (``loom serve`` on a free port); this process is the client,
using the generated stubs the way a microservice would: GenerateStream with token ids, greedy,
EOS ignored, token ids returned. Requests arrive all at once or as a seeded Poisson process.
The same requests with the same arrival times then go to an in-process engine client
(:class:`AsyncEngineClient`, same engine config, no gRPC, no detokenizer), and
``grpc_overhead = 1 - grpc out tok/s / engine out tok/s`` is what the API layer costs.

Per request: TTFT (submit to first token), TPOT = (latency - TTFT) / (output tokens - 1), ITL
(gaps between tokens; tokens that arrive in one message share its arrival time) and end-to-end
latency; over the run: request/s and output tok/s from the first submit to the last token.

With Poisson arrivals those run totals include the ramp-up and the drain after the last arrival
(at least one request's whole latency: 256 tokens at 10 ms are 2.6 s of a 12.5 s run), so even a
server that keeps up reads well below the offered load. Whether it keeps up is what
``sustained`` says: requests completed per second between the first and the last completion,
against requests sent per second between the first and the last submit (``share`` 1.0: the
server finishes requests as fast as they come; a server falling behind stretches the
completions over a longer span than the arrivals), each also as output tok/s (times the mean
output of a request).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loom.config import EngineConfig
from loom.process_tuning import freeze_startup_objects

from .run_loom import warmup_prompts
from .workloads import Workload

# One request's stream: yields how many tokens each message (or engine output) carried.
StreamFn = Callable[[str, list[int], int], AsyncIterator[int]]


@dataclass
class RequestTiming:
    submit: float
    stamps: list[float] = field(default_factory=list)  # arrival time of each output token


def arrival_offsets(count: int, rate: float, seed: int = 0) -> list[float]:
    """Seconds after the start at which each request is sent: all 0 for ``rate`` inf, else a
    Poisson process of ``rate`` requests/s (exponential gaps, ``random.Random(seed)``)."""
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(count):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    s = sorted(values)

    def pct(q: float) -> float:
        return s[min(len(s) - 1, round(q * (len(s) - 1)))]

    return {"mean": statistics.fmean(s), "p50": pct(0.5), "p99": pct(0.99)}


def summarize(timings: list[RequestTiming], w: Workload) -> dict[str, Any]:
    start = min(t.submit for t in timings)
    end = max(t.stamps[-1] for t in timings)
    duration = end - start
    ttft = [t.stamps[0] - t.submit for t in timings]
    e2e = [t.stamps[-1] - t.submit for t in timings]
    tpot = [(e - f) / (len(t.stamps) - 1) for t, e, f in zip(timings, e2e, ttft, strict=True) if len(t.stamps) > 1]
    itl = [b - a for t in timings for a, b in itertools.pairwise(t.stamps)]
    out_tokens = sum(len(t.stamps) for t in timings)
    submits = sorted(t.submit for t in timings)
    completions = sorted(t.stamps[-1] for t in timings)
    sustained: dict[str, float] | None = None
    if len(timings) > 1 and submits[-1] > submits[0] and completions[-1] > completions[0]:
        per_request = out_tokens / len(timings)
        offered = (len(timings) - 1) / (submits[-1] - submits[0])
        served = (len(timings) - 1) / (completions[-1] - completions[0])
        sustained = {"offered_request_s": offered, "served_request_s": served,
                     "offered_out_tok_s": offered * per_request, "served_out_tok_s": served * per_request,
                     "share": served / offered}
    return {
        "requests": len(timings),
        "s": duration,
        "out_tokens": out_tokens,
        "request_s": len(timings) / duration,
        "out_tok_s": out_tokens / duration,
        "total_tok_s": (out_tokens + w.prompt_tokens) / duration,
        "ttft_s": _stats(ttft),
        "tpot_s": _stats(tpot),
        "itl_s": _stats(itl),
        "e2e_s": _stats(e2e),
        "sustained": sustained,  # None when every request arrived at once
    }


async def drive(stream: StreamFn, w: Workload, offsets: list[float], tag: str) -> list[RequestTiming]:
    """Send request i at ``offsets[i]`` after the start; record when each token arrives."""

    async def one(i: int, prompt: list[int], new: int, start: float) -> RequestTiming:
        await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
        timing = RequestTiming(submit=time.perf_counter())
        async for count in stream(f"{tag}-{i}", prompt, new):
            if count:
                timing.stamps.extend([time.perf_counter()] * count)
        if len(timing.stamps) != new:
            raise RuntimeError(f"W3 request {i} got {len(timing.stamps)} of {new} tokens")
        return timing

    start = time.perf_counter()
    return list(await asyncio.gather(*(one(i, p, n, start) for i, (p, n) in enumerate(w.requests))))


async def _warm(stream: StreamFn, w: Workload, tag: str) -> None:
    async def one(i: int, prompt: list[int]) -> None:
        async for _ in stream(f"{tag}-warm-{i}", prompt, 4):
            pass

    await asyncio.gather(*(one(i, p) for i, p in enumerate(warmup_prompts(w))))


# -- the gRPC side -----------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_args(cfg: EngineConfig, port: int, max_concurrent: int) -> list[str]:
    """``loom serve`` flags for ``cfg``: every engine field that differs from its default (the
    metrics endpoint off, so its fixed port never clashes with another server)."""
    from loom.server.settings import ServerSettings

    args = ["--host", "127.0.0.1", "--port", str(port), "--max-concurrent-requests", str(max_concurrent)]
    if "prometheus_port" in {f.name for f in dataclasses.fields(ServerSettings)}:
        args += ["--prometheus-port", "0"]  # no fixed metrics port to clash with another server
    defaults = EngineConfig()
    for f in dataclasses.fields(EngineConfig):
        value = getattr(cfg, f.name)
        if value is None or value == getattr(defaults, f.name):
            continue
        text = ",".join(str(v) for v in value) if isinstance(value, (tuple, list)) else str(value)
        args += ["--" + f.name.replace("_", "-"), text]
    return args


class ServerProcess:
    """``loom serve`` as a child process of the bench, its output in a log file."""

    def __init__(self, cfg: EngineConfig, max_concurrent: int) -> None:
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", "loom.cli", "serve", *serve_args(cfg, self.port, max_concurrent)]
        fd, name = tempfile.mkstemp(prefix="loom-bench-serve-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def log_tail(self, chars: int = 12000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    async def wait_serving(self, timeout: float) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout
        async with grpc.aio.insecure_channel(self.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"loom serve exited with {self.proc.returncode}:\n{self.log_tail()}")
                try:
                    resp = await health.Check(health_pb2.HealthCheckRequest(), timeout=2)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass  # not listening yet
                await asyncio.sleep(0.2)
        raise TimeoutError(f"loom serve not SERVING after {timeout} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._log.close()
        return code


async def run_grpc(cfg: EngineConfig, w: Workload, offsets: list[float],
                   startup_timeout: float = 900.0) -> tuple[list[RequestTiming], str]:
    import grpc

    from loom_client.v1 import generation_pb2 as pb
    from loom_client.v1 import generation_pb2_grpc as pb_grpc

    server = ServerProcess(cfg, max(128, len(w.requests) + 8))
    try:
        await server.wait_serving(startup_timeout)
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)

            async def stream(rid: str, prompt: list[int], new: int) -> AsyncIterator[int]:
                params = pb.Parameters(
                    sampling=pb.SamplingParameters(do_sample=False),
                    stopping=pb.StoppingParameters(max_new_tokens=new, ignore_eos=True),
                    response=pb.ResponseParameters(tokens=True),  # token-id clients want the ids back
                )
                request = pb.GenerateStreamRequest(request_id=rid, token_ids=pb.TokenIds(ids=prompt),
                                                   parameters=params)
                async for msg in stub.GenerateStream(request):
                    yield len(msg.tokens)

            await _warm(stream, w, "grpc")
            timings = await drive(stream, w, offsets, "grpc")
    except BaseException:
        server.stop(10)
        sys.stderr.write(f"loom serve log ({server.log_path}):\n{server.log_tail()}\n")
        raise
    code = server.stop()
    if code != 0:
        sys.stderr.write(f"loom serve exited with {code}; log: {server.log_path}\n")
    return timings, "loom " + shlex.join(server.argv[3:])


# -- the in-process engine side ----------------------------------------------------------------------------


async def run_engine(cfg: EngineConfig, w: Workload, offsets: list[float]) -> list[RequestTiming]:
    from loom.engine.core_process import AsyncEngineClient
    from loom.engine.types import EngineRequest, SamplingParams, StoppingParams

    client = AsyncEngineClient(cfg)
    await client.start()
    freeze_startup_objects()  # as the gRPC server's front end does once started
    try:
        async def stream(rid: str, prompt: list[int], new: int) -> AsyncIterator[int]:
            req = EngineRequest(rid, tuple(prompt), SamplingParams(),
                                StoppingParams(max_new_tokens=new, ignore_eos=True))
            async for out in client.generate(req):
                if out.error:
                    raise RuntimeError(f"{rid} failed in the engine: {out.error}")
                yield len(out.token_ids)

        await _warm(stream, w, "engine")
        return await drive(stream, w, offsets, "engine")
    finally:
        await client.shutdown()


async def run_w3(cfg: EngineConfig, w: Workload, rate: float, seed: int = 0, repeats: int = 1) -> dict[str, Any]:
    """W3 through gRPC and the same requests in process; one server or engine at a time, so they
    never share the device.

    With ``repeats`` > 1 the pair runs that many times in alternating order (gRPC first, then the
    engine first, ...): on a small, noisy machine the run that comes second was seen to be up to
    ~15% faster whichever side it was, so a single pair measures its order, not gRPC. The overhead
    is then taken from the mean output tok/s of each side; ``grpc`` / ``engine`` hold the
    summaries of the first pair and ``runs`` every pair's figures."""
    offsets = arrival_offsets(len(w.requests), rate, seed)
    runs: list[dict[str, Any]] = []
    first: tuple[dict[str, Any], dict[str, Any]] | None = None
    server_command = ""
    for i in range(max(1, repeats)):
        if i % 2 == 0:
            grpc_timings, server_command = await run_grpc(cfg, w, offsets)
            engine_timings = await run_engine(cfg, w, offsets)
        else:
            engine_timings = await run_engine(cfg, w, offsets)
            grpc_timings, server_command = await run_grpc(cfg, w, offsets)
        grpc_summary, engine_summary = summarize(grpc_timings, w), summarize(engine_timings, w)
        first = first or (grpc_summary, engine_summary)
        runs.append({"order": "grpc, engine" if i % 2 == 0 else "engine, grpc",
                     "grpc_out_tok_s": grpc_summary["out_tok_s"], "engine_out_tok_s": engine_summary["out_tok_s"]})
    grpc_mean = statistics.fmean(r["grpc_out_tok_s"] for r in runs)
    engine_mean = statistics.fmean(r["engine_out_tok_s"] for r in runs)
    assert first is not None
    return {
        "description": w.description,
        "arrivals": "all at once" if math.isinf(rate) else f"Poisson {rate} req/s (seed {seed})",
        "server": server_command,
        "grpc": first[0],
        "engine": first[1],
        "runs": runs,
        "grpc_mean_out_tok_s": grpc_mean,
        "engine_mean_out_tok_s": engine_mean,
        "grpc_overhead": 1.0 - grpc_mean / engine_mean,
    }
