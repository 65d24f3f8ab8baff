"""Soak: several hundred requests of every kind through gRPC, with faults injected in the engine.

The real server runs a tiny random-weight Llama with --fault-injection. A reference pass first runs
each valid request alone, one at a time; then a seeded random mix runs with bounded concurrency:
valid requests (unary and streaming), client cancellations mid-stream, short deadlines, invalid
requests, and requests named inject-fault-* (the model step raises) or inject-nan-* (NaN logits).

Asserted: every valid request completes with exactly its reference output; every invalid one gets
INVALID_ARGUMENT; every injected one gets INTERNAL with its message; no UNKNOWN, nothing else; the
server stays SERVING; the KV pool is whole again at shutdown; the RSS of the server and of the
engine process grows by less than RSS_BOUND_MIB between the end of a warm-up and the end.

The figures go to soak.json in the test's temporary folder, and to $LOOM_SOAK_RESULTS when set
(bench/results/soak.json in the repository: see docs/soak.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from loom_client.v1 import generation_pb2 as pb
from loom_client.v1 import generation_pb2_grpc as pb_grpc

from .server_process import ServerProcess, engine_pid, rss_mib, start_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SEED = 20261129
NUM_REFERENCE = 40  # distinct valid requests, each run alone first
NUM_WARMUP = 60  # mixed requests before the first RSS reading
NUM_SOAK = 300  # mixed requests after it
CONCURRENCY = 24
RSS_BOUND_MIB = 50
WEIGHTS = {"valid": 45, "cancel": 10, "deadline": 10, "invalid": 15, "inject-fault": 10, "inject-nan": 10}
WORDS = ["loom", "weave", "thread", "shuttle", "warp", "weft", "cloth", "pattern", "spindle", "yarn", "silk", "cotton", "wool", "dye", "color", "river", "mountain", "garden", "window", "lantern", "harbor", "engine", "signal", "number", "story", "question", "answer"]


@pytest.fixture(scope="module")
def soak_server(tiny_llama_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    server = start_server(tiny_llama_dir, server_logs, "soak", "--fault-injection",
                          "--max-concurrent-requests", "16", "--max-queue", "256",
                          "--max-total-tokens", "1024", "--max-input-tokens", "1000",
                          "--max-batch-total-tokens", "16384")
    yield server
    server.stop()


# -- the requests ----------------------------------------------------------------------------------
def reference_requests(rng: random.Random) -> list[dict[str, Any]]:
    out = []
    for i in range(NUM_REFERENCE):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40)))
        stopping = pb.StoppingParameters(max_new_tokens=rng.randint(4, 16), ignore_eos=rng.random() < 0.5)
        if rng.random() < 0.2:
            stopping.stop_sequences.append(rng.choice("aeiou"))
        out.append({"text": f"{i}: {words}", "parameters": pb.Parameters(stopping=stopping)})
    return out


def _sampling(**kw: Any) -> pb.Parameters:
    return pb.Parameters(sampling=pb.SamplingParameters(**kw))


def _stopping(**kw: Any) -> pb.Parameters:
    return pb.Parameters(stopping=pb.StoppingParameters(**kw))


INVALID: list[dict[str, Any]] = [
    {},
    {"text": ""},
    {"text": "hi", "parameters": _sampling(temperature=-1)},
    {"text": "hi", "parameters": _sampling(top_p=1.5)},
    {"text": "hi", "parameters": _sampling(top_p=float("nan"))},
    {"text": "hi", "parameters": _sampling(temperature=float("inf"))},
    {"text": "hi", "parameters": _stopping(max_new_tokens=0)},
    {"text": "hi", "parameters": _stopping(max_new_tokens=5000)},
    {"text": "hi", "parameters": _stopping(max_new_tokens=2, min_new_tokens=3)},
    {"text": "hi", "parameters": _stopping(stop_sequences=["a"] * 9)},
    {"text": "hi", "parameters": _stopping(stop_token_ids=[10**9])},
    {"text": "hi", "parameters": pb.Parameters(n=7)},
    {"text": "hi", "parameters": pb.Parameters(n=1, best_of=2)},  # greedy best_of > n
    {"text": "hi", "parameters": pb.Parameters(response=pb.ResponseParameters(top_n_tokens=99))},
    {"text": "hi", "parameters": pb.Parameters(penalties=pb.PenaltyParameters(repetition_penalty=0))},
    {"text": "hi", "parameters": pb.Parameters(truncate_input_tokens=0)},
    {"token_ids": pb.TokenIds(ids=[5, 10**6])},
    {"token_ids": pb.TokenIds(ids=[5] * 1001)},
    {"chat": pb.Chat(messages=[pb.ChatMessage(role="robot", content="hi")])},
    {"chat": pb.Chat()},
    {"text": "hi", "request_id": "r" * 300},
    {"text": "x" * 300_000},  # over the default --max-input-chars
]


@dataclass
class Job:
    kind: str
    index: int
    stream: bool
    fields: dict[str, Any]
    ref: int | None = None  # index into the reference list
    timeout: float = 120.0
    cancel_after: int = 0


def make_jobs(rng: random.Random, count: int, refs: list[dict[str, Any]], start: int) -> list[Job]:
    kinds, weights = zip(*WEIGHTS.items(), strict=True)
    jobs = []
    for i in range(start, start + count):
        kind = rng.choices(kinds, weights)[0]
        stream = rng.random() < 0.5
        long = pb.Parameters(stopping=pb.StoppingParameters(max_new_tokens=400, ignore_eos=True))
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 20)))
        if kind == "valid":
            ref = rng.randrange(len(refs))
            jobs.append(Job(kind, i, stream, {"request_id": f"valid-{i}", **refs[ref]}, ref=ref))
        elif kind == "cancel":
            jobs.append(Job(kind, i, True, {"request_id": f"cancel-{i}", "text": words, "parameters": long},
                            cancel_after=rng.randint(1, 4)))
        elif kind == "deadline":
            jobs.append(Job(kind, i, stream, {"request_id": f"deadline-{i}", "text": words, "parameters": long},
                            timeout=rng.uniform(0.05, 0.5)))
        elif kind == "invalid":
            jobs.append(Job(kind, i, stream, {"request_id": f"invalid-{i}", **rng.choice(INVALID)}))
        else:
            params = pb.Parameters(stopping=pb.StoppingParameters(max_new_tokens=rng.randint(2, 12)))
            jobs.append(Job(kind, i, stream, {"request_id": f"{kind}-{i}", "text": words, "parameters": params}))
    return jobs


# -- running them ------------------------------------------------------------------------------------
@dataclass
class Output:
    text: str
    finish_reason: int
    generated_tokens: int


async def call(stub: Any, job: Job) -> Output | None:
    """The output of a completed request; None when the client cancelled it on purpose."""
    if not job.stream:
        reply = await stub.Generate(pb.GenerateRequest(**job.fields), timeout=job.timeout)
        c = reply.completions[0]
        return Output(c.text, c.finish_reason, c.generated_tokens)
    rpc = stub.GenerateStream(pb.GenerateStreamRequest(**job.fields), timeout=job.timeout)
    text, last, seen = "", None, 0
    async for msg in rpc:
        text += msg.text
        last = msg
        seen += 1
        if job.cancel_after and seen >= job.cancel_after:
            rpc.cancel()
            return None
    assert last is not None
    return Output(text, last.finish_reason, last.usage.generated_tokens)


EXPECTED = {"invalid": grpc.StatusCode.INVALID_ARGUMENT, "deadline": grpc.StatusCode.DEADLINE_EXCEEDED,
            "inject-fault": grpc.StatusCode.INTERNAL, "inject-nan": grpc.StatusCode.INTERNAL}
MESSAGES = {"inject-fault": "injected failure", "inject-nan": "non-finite logits"}


async def run_job(stub: Any, job: Job, refs: list[Output], outcomes: Counter[str], problems: list[str]) -> None:
    try:
        out = await call(stub, job)
    except grpc.aio.AioRpcError as err:
        code = err.code()
        outcomes[code.name] += 1
        if code != EXPECTED.get(job.kind):
            problems.append(f"{job.kind} #{job.index} ({'stream' if job.stream else 'unary'}): "
                            f"{code.name}: {err.details()}")
        elif job.kind in MESSAGES and MESSAGES[job.kind] not in (err.details() or ""):
            problems.append(f"{job.kind} #{job.index}: message {err.details()!r}")
        return
    if out is None:
        outcomes["CANCELLED (by the client)"] += 1
        return
    if job.kind == "cancel":  # coalescing can pack all its tokens into fewer messages than planned
        outcomes["OK (ended before the client's cancel)"] += 1
        return
    outcomes["OK"] += 1
    if job.kind != "valid":
        problems.append(f"{job.kind} #{job.index} completed: {out}")
    elif job.ref is not None and out != refs[job.ref]:
        problems.append(f"valid #{job.index} (ref {job.ref}, {'stream' if job.stream else 'unary'}) "
                        f"differs from its solo run: {out} != {refs[job.ref]}")


async def run_mix(address: str, jobs: list[Job], refs: list[Output], outcomes: Counter[str],
                  problems: list[str]) -> None:
    limit = asyncio.Semaphore(CONCURRENCY)

    async def bounded(stub: Any, job: Job) -> None:
        async with limit:
            await run_job(stub, job, refs, outcomes, problems)

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        await asyncio.gather(*(bounded(stub, job) for job in jobs))


async def run_reference(address: str, requests: list[dict[str, Any]]) -> list[Output]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        out = []
        for i, fields in enumerate(requests):
            reply = await stub.Generate(pb.GenerateRequest(request_id=f"reference-{i}", **fields), timeout=60)
            c = reply.completions[0]
            out.append(Output(c.text, c.finish_reason, c.generated_tokens))
        return out


# -- observing the server ------------------------------------------------------------------------------
def test_soak(soak_server: ServerProcess, tmp_path: Path) -> None:
    started = time.monotonic()
    rng = random.Random(SEED)
    requests = reference_requests(rng)
    refs = asyncio.run(run_reference(soak_server.address, requests))
    assert len({r.text for r in refs}) > NUM_REFERENCE // 2  # the reference outputs are not all alike

    outcomes: Counter[str] = Counter()
    problems: list[str] = []
    warmup = make_jobs(rng, NUM_WARMUP, requests, 0)
    asyncio.run(run_mix(soak_server.address, warmup, refs, outcomes, problems))
    server_pid, eng_pid = soak_server.proc.pid, engine_pid(soak_server.proc.pid)
    rss_before = {"server": rss_mib(server_pid), "engine": rss_mib(eng_pid)}

    jobs = make_jobs(rng, NUM_SOAK, requests, NUM_WARMUP)
    soak_started = time.monotonic()
    asyncio.run(run_mix(soak_server.address, jobs, refs, outcomes, problems))
    soak_s = time.monotonic() - soak_started
    rss_after = {"server": rss_mib(server_pid), "engine": rss_mib(eng_pid)}
    health = soak_server.health_status()

    code = soak_server.stop()
    stats = re.search(r"engine stats at shutdown.*", soak_server.log_text())
    free = re.search(r"free_blocks=(\d+)", stats.group(0)) if stats else None
    total = re.search(r" blocks=(\d+)", stats.group(0)) if stats else None
    kinds = Counter(job.kind for job in warmup + jobs)
    figures = {
        "command": "LOOM_SOAK_RESULTS=bench/results/soak.json pytest -q tests/e2e/test_soak.py",
        "model": "random-weight 2-layer Llama (hidden 64) with the SmolLM2 tokenizer, fp32, CPU",
        "server_flags": "--fault-injection --max-concurrent-requests 16 --max-queue 256 "
                        "--max-total-tokens 1024 --max-batch-total-tokens 16384",
        "client_concurrency": CONCURRENCY,
        "requests": {"reference_alone": NUM_REFERENCE, "mixed": len(warmup) + len(jobs),
                     "total": NUM_REFERENCE + len(warmup) + len(jobs)},
        "requests_by_kind": dict(sorted(kinds.items())),
        "faults_injected": kinds["inject-fault"] + kinds["inject-nan"],
        "outcomes_by_status": dict(sorted(outcomes.items())),
        "problems": len(problems),
        "duration_s": {"total": round(time.monotonic() - started, 1), "soak_phase": round(soak_s, 1)},
        "rss_mib": {"after_warmup": {k: round(v, 1) for k, v in rss_before.items()},
                    "at_end": {k: round(v, 1) for k, v in rss_after.items()}},
        "kv_blocks_at_shutdown": {"free": int(free.group(1)) if free else None,
                                  "total": int(total.group(1)) if total else None},
        "health_at_end": health,
        "exit_code": code,
    }
    text = json.dumps(figures, indent=2) + "\n"
    (tmp_path / "soak.json").write_text(text)
    if os.environ.get("LOOM_SOAK_RESULTS"):
        Path(os.environ["LOOM_SOAK_RESULTS"]).write_text(text)
    print(text)

    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:20])
    assert "UNKNOWN" not in outcomes
    assert health == "SERVING"
    assert code == 0
    assert free is not None and total is not None and free.group(1) == total.group(1), stats
    for proc in ("server", "engine"):
        grew = rss_after[proc] - rss_before[proc]
        assert grew < RSS_BOUND_MIB, f"{proc} RSS grew by {grew:.1f} MiB: {rss_before} -> {rss_after}"
    # Every kind really happened, with the status it must have.
    assert outcomes["INVALID_ARGUMENT"] == kinds["invalid"]
    assert outcomes["INTERNAL"] == kinds["inject-fault"] + kinds["inject-nan"] > 0
    assert outcomes["CANCELLED (by the client)"] > 0
    assert outcomes["CANCELLED (by the client)"] + outcomes["OK (ended before the client's cancel)"] == kinds["cancel"]
    assert outcomes["DEADLINE_EXCEEDED"] == kinds["deadline"] > 0
