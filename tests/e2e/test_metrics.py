"""/metrics after a known mix of traffic: every count adds up.

A server of its own, so no other test's traffic mixes in; counts are taken as differences from a
scrape before the traffic (start-up itself makes a Generate while loading, and health checks).
The mix: N unary and M streaming successes, K invalid requests, one stream the client cancels
and one unary request whose deadline passes mid-generation.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loom_client.v1 import generation_pb2 as pb

from .server_process import ServerProcess, start_server

pytestmark = pytest.mark.e2e

GENERATE = "/loom.v1.GenerationService/Generate"
STREAM = "/loom.v1.GenerationService/GenerateStream"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    server = start_server(tiny_llama_dir, server_logs, "metrics", "--max-total-tokens", "4096",
                          "--max-batch-total-tokens", "65536")
    yield server
    server.stop()


def scrape(server: ServerProcess, path: str = "/metrics") -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}{path}", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def failures(samples: Samples) -> float:
    return sum(v for (name, _), v in samples.items() if name == "loom_request_failure_total")


def settled(server: ServerProcess) -> Samples:
    """A scrape once every request has ended (its handler records after the client sees the end)."""
    deadline = time.monotonic() + 30
    while True:
        s = scrape(server)
        done = value(s, "loom_request_count_total") == value(s, "loom_request_success_total") + failures(s)
        idle = (value(s, "loom_kv_cache_free_blocks") == value(s, "loom_kv_cache_blocks") > 0
                and value(s, "loom_batch_current_size") == 0)
        if (done and idle) or time.monotonic() > deadline:
            return s
        time.sleep(0.1)


def stopping(max_new_tokens: int) -> pb.Parameters:
    return pb.Parameters(stopping=pb.StoppingParameters(max_new_tokens=max_new_tokens, ignore_eos=True))


def test_counts_add_up_after_traffic(server: ServerProcess) -> None:
    before = settled(server)
    unary_tokens = [3, 5, 8]  # N = 3
    stream_tokens = [4, 6]  # M = 2
    generated = 0
    prompt_tokens = 0
    for n in unary_tokens:
        resp = server.stub.Generate(pb.GenerateRequest(text="Hello there", parameters=stopping(n)), timeout=60)
        assert resp.completions[0].generated_tokens == n
        generated += resp.usage.generated_tokens
        prompt_tokens += resp.usage.prompt_tokens
    for n in stream_tokens:
        msgs = list(server.stub.GenerateStream(pb.GenerateStreamRequest(text="Once upon", parameters=stopping(n)),
                                               timeout=60))
        generated += msgs[-1].usage.generated_tokens
        prompt_tokens += msgs[-1].usage.prompt_tokens
    assert generated == sum(unary_tokens) + sum(stream_tokens)
    invalid = [pb.GenerateRequest(text=""), pb.GenerateRequest(text="Hi", parameters=stopping(5000))]  # K = 2
    for request in invalid:
        with pytest.raises(grpc.RpcError) as info:
            server.stub.Generate(request, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # One stream cancelled by the client after two messages, one unary call past its deadline.
    stream = server.stub.GenerateStream(pb.GenerateStreamRequest(text="Long", parameters=stopping(4000)), timeout=60)
    next(stream)
    next(stream)
    stream.cancel()
    with pytest.raises(grpc.RpcError) as info:
        server.stub.Generate(pb.GenerateRequest(text="Long", parameters=stopping(4000)), timeout=1.0)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    after = settled(server)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    n, m, k = len(unary_tokens), len(stream_tokens), len(invalid)
    ok = n + m
    # Requests: each ends in exactly one of success or failure{err}.
    assert delta("loom_request_count_total") == ok + k + 2
    assert delta("loom_request_success_total") == ok
    assert delta("loom_request_failure_total", err="validation") == k
    assert delta("loom_request_failure_total", err="cancelled") == 1
    assert delta("loom_request_failure_total", err="deadline") == 1
    assert value(after, "loom_request_count_total") == value(after, "loom_request_success_total") + failures(after)
    # Per RPC, by status code; the latency histogram counts the same calls.
    expected_rpcs = {(GENERATE, "OK"): n, (GENERATE, "INVALID_ARGUMENT"): k, (GENERATE, "DEADLINE_EXCEEDED"): 1,
                     (STREAM, "OK"): m, (STREAM, "CANCELLED"): 1}
    for (method, code), count in expected_rpcs.items():
        assert delta("loom_grpc_requests_total", method=method, code=code) == count, (method, code)
        assert delta("loom_grpc_request_duration_seconds_count", method=method, code=code) == count, (method, code)
    assert value(after, "loom_grpc_requests_total", method=HEALTH_CHECK, code="OK") > 0
    # Token latency: every request that got a token has a TTFT (the cancelled and late ones did).
    assert delta("loom_time_to_first_token_seconds_count") == ok + 2
    assert delta("loom_inter_token_latency_seconds_count") >= generated - ok
    # Request-level histograms of the successful ones; validated ones for the inputs.
    assert delta("loom_request_generated_tokens_count") == ok
    assert delta("loom_request_generated_tokens_sum") == generated
    assert delta("loom_request_duration_count") == ok
    assert delta("loom_request_inference_duration_count") == ok
    assert delta("loom_request_mean_time_per_token_duration_count") == ok  # every one made 2+ tokens
    assert delta("loom_request_input_length_count") == ok + 2
    assert delta("loom_request_validation_duration_count") == ok + 2
    assert delta("loom_request_queue_duration_count") == ok + 2
    assert delta("loom_request_max_new_tokens_sum") == sum(unary_tokens) + sum(stream_tokens) + 2 * 4000
    assert delta("loom_request_input_length_sum") >= prompt_tokens  # the two long ones add theirs
    # The engine, once idle: every KV block back, nothing running or queued.
    assert value(after, "loom_kv_cache_free_blocks") == value(after, "loom_kv_cache_blocks") > 0
    assert value(after, "loom_kv_cache_usage_ratio") == 0.0
    assert value(after, "loom_batch_current_size") == 0
    assert value(after, "loom_queue_size", queue="engine") == 0
    assert value(after, "loom_queue_size", queue="admission") == 0
    assert value(after, "loom_batch_max_total_tokens") == 65536
    assert delta("loom_engine_steps_total") >= max(unary_tokens)
    assert delta("loom_prefill_chunks_total") == 0  # short prompts: none was split
    assert value(after, "loom_prefix_cache_queries_total") >= value(after, "loom_prefix_cache_hits_total")
    assert delta("loom_preemptions_total") == 0


def test_only_metrics_path_is_served(server: ServerProcess) -> None:
    assert scrape(server, "/")  # the root answers too
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/other", timeout=10)
    assert info.value.code == 404
