"""Structured output through a real server on the real SmolLM2 (CPU): every output that ends by
EOS validates against its schema (jsonschema), regex and choice outputs match, bad constraints
are refused with the right status before queueing, a slowly compiling grammar leaves the other
requests' tokens flowing, and the compile time limit fires (a server of its own, tiny model, its
matchers in a grammar process)."""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import string
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from prometheus_client.parser import text_string_to_metric_families

from loom_client.v1 import generation_pb2 as pb

from .server_process import ServerProcess, start_server

pytestmark = pytest.mark.e2e
jsonschema = pytest.importorskip("jsonschema")

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"]}},
        "required": ["name", "address"]},
    "array": {"type": "object", "properties": {
        "fruits": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3}},
        "required": ["fruits"]},
    "enum": {"type": "object", "properties": {
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "confidence": {"type": "string", "enum": ["low", "high"]}},
        "required": ["sentiment", "confidence"]},
    "optional": {"type": "object", "properties": {
        f"field_{i}": {"type": "string", "maxLength": 10} for i in range(10)}},
    "bounds": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "height_m": {"type": "number", "minimum": 0.5, "maximum": 2.5},
        "score": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}},
        "required": ["age", "height_m", "score"]},
}
PROMPTS = {
    "nested": "Give the name and postal address of a person as JSON.",
    "array": "List some fruits as JSON.",
    "enum": "Classify the sentiment of 'I love this movie' as JSON.",
    "optional": "Describe a car as JSON.",
    "bounds": "Describe a person's age, height in meters and a score as JSON.",
}


def generate(server: ServerProcess, prompt: str, constraint: pb.Constraint, n: int = 1, max_new: int = 80,
             timeout: float = 240, **response: Any) -> pb.GenerateResponse:
    params = pb.Parameters(sampling=pb.SamplingParameters(temperature=0.7, seed=11), n=n,
                           stopping=pb.StoppingParameters(max_new_tokens=max_new),
                           response=pb.ResponseParameters(**response), constraint=constraint)
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content=prompt)])
    return server.stub.Generate(pb.GenerateRequest(chat=chat, parameters=params), timeout=timeout)


def test_every_output_that_ends_by_eos_validates(smol_server: ServerProcess) -> None:
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        replies = {name: pool.submit(generate, smol_server, PROMPTS[name],
                                     pb.Constraint(json_schema=json.dumps(schema)))
                   for name, schema in SCHEMAS.items()}
        results = {name: f.result() for name, f in replies.items()}
    ended = 0
    for name, reply in results.items():
        for c in reply.completions:
            if c.finish_reason == pb.FINISH_REASON_EOS_TOKEN:
                ended += 1
                jsonschema.validate(json.loads(c.text), SCHEMAS[name])  # parses, and validates
            else:
                assert c.finish_reason == pb.FINISH_REASON_LENGTH and c.generated_tokens == 80
    assert ended >= 3, {n: [(c.finish_reason, c.text) for c in r.completions] for n, r in results.items()}
    # the same prompts without a schema: the model's own answer is not a bare JSON document
    free = smol_server.stub.Generate(pb.GenerateRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=PROMPTS["nested"])]),
        parameters=pb.Parameters(stopping=pb.StoppingParameters(max_new_tokens=40))), timeout=120)
    with pytest.raises(ValueError):
        json.loads(free.completions[0].text)


def test_regex_choice_and_json_object(smol_server: ServerProcess) -> None:
    phone = generate(smol_server, "What is a phone number?", pb.Constraint(regex=r"\(\d{3}\) \d{3}-\d{4}"), max_new=32)
    c = phone.completions[0]
    assert c.finish_reason == pb.FINISH_REASON_EOS_TOKEN and re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", c.text), c
    choices = ["Paris", "London", "Berlin"]
    reply = generate(smol_server, "What is the capital of France?", pb.Constraint(choice=pb.Choice(choices=choices)),
                     n=2, max_new=16, logprobs=True, top_n_tokens=3)
    for c in reply.completions:
        assert c.finish_reason == pb.FINISH_REASON_EOS_TOKEN and c.text in choices
        first = c.tokens[0]
        assert first.logprob <= 0 and all(t.logprob <= 0 for t in first.top_tokens)
        # alternatives are only tokens some choice starts with (the constraint's distribution)
        assert all(any(ch.startswith(t.text) for ch in choices) for t in first.top_tokens), first
    obj = generate(smol_server, "Describe a dog as JSON.", pb.Constraint(json_object=pb.JsonObject()), max_new=40)
    if obj.completions[0].finish_reason == pb.FINISH_REASON_EOS_TOKEN:
        assert isinstance(json.loads(obj.completions[0].text), dict)
    else:
        assert obj.completions[0].text.startswith("{")


def test_streaming_with_a_constraint(smol_server: ServerProcess) -> None:
    params = pb.Parameters(stopping=pb.StoppingParameters(max_new_tokens=24),
                           constraint=pb.Constraint(regex="[0-9]{4}-[0-9]{2}-[0-9]{2}"))
    chunks = list(smol_server.stub.GenerateStream(pb.GenerateStreamRequest(text="Today's date is", parameters=params),
                                                  timeout=120))
    assert chunks[-1].finish_reason == pb.FINISH_REASON_EOS_TOKEN
    assert re.fullmatch("[0-9]{4}-[0-9]{2}-[0-9]{2}", "".join(m.text for m in chunks))


def _status(exc: grpc.RpcError) -> tuple[grpc.StatusCode, list[tuple[str, str]], str]:
    details = dict(exc.trailing_metadata() or ())["grpc-status-details-bin"]  # type: ignore[attr-defined]
    status = status_pb2.Status.FromString(details)
    violations: list[tuple[str, str]] = []
    reason = ""
    for any_msg in status.details:
        if any_msg.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            any_msg.Unpack(bad)
            violations += [(v.field, v.description) for v in bad.field_violations]
        elif any_msg.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            any_msg.Unpack(info)
            reason = info.reason
    return exc.code(), violations, reason  # type: ignore[attr-defined]


@pytest.mark.parametrize(("constraint", "field", "words"), [
    (pb.Constraint(json_schema='{"type": "number", "multipleOf": 0.5}'), "parameters.constraint.json_schema",
     "multipleOf"),
    (pb.Constraint(json_schema='{"type": "string", "pattern": "[a-z]+", "minLength": 3}'),
     "parameters.constraint.json_schema", "minLength"),
    (pb.Constraint(json_schema='{"type": "string", "format": "phone"}'), "parameters.constraint.json_schema",
     "format 'phone'"),
    (pb.Constraint(json_schema="{not json"), "parameters.constraint.json_schema", "not valid JSON"),
    (pb.Constraint(regex="(a|b"), "parameters.constraint.regex", "parenthesis"),
    (pb.Constraint(grammar='rooot ::= "a"'), "parameters.constraint.grammar", "root"),
    (pb.Constraint(choice=pb.Choice()), "parameters.constraint.choice.choices", "at least one"),
])
def test_invalid_constraints_are_refused_before_queueing(smol_server: ServerProcess, constraint: pb.Constraint,
                                                         field: str, words: str) -> None:
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        smol_server.stub.Generate(pb.GenerateRequest(text="Hi", parameters=pb.Parameters(constraint=constraint)),
                                  timeout=60)
    code, violations, _ = _status(info.value)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert violations[0][0] == field and words in violations[0][1], violations
    assert time.monotonic() - started < 5  # refused by validation, not after a compile in the engine


def slow_regex(classes: int = 36) -> str:
    """A regex that takes seconds to compile on SmolLM2's vocabulary (each distinct bounded class
    adds parser states whose token masks are precomputed), unique so no cache has it."""
    lo, hi = string.ascii_lowercase[:13], string.ascii_lowercase[13:]
    parts = [f"[{lo[i % 13]}-{hi[(i // 13) % 13]}]{{1,300}}," for i in range(classes)]
    return f"{uuid.uuid4().hex[:8]}:" + "".join(parts)


def scrape(server: ServerProcess) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            out[key] = s.value
    return out


def test_a_slow_grammar_does_not_delay_other_requests(smol_server: ServerProcess) -> None:
    stamps: dict[int, list[float]] = {0: [], 1: []}
    calls: list[Any] = []

    def stream(i: int) -> None:
        params = pb.Parameters(stopping=pb.StoppingParameters(max_new_tokens=1000, ignore_eos=True))
        call = smol_server.stub.GenerateStream(pb.GenerateStreamRequest(text=f"Story {i}:", parameters=params),
                                               timeout=300)
        calls.append(call)
        with contextlib.suppress(grpc.RpcError):  # cancelled below, once measured
            for msg in call:
                if msg.text or msg.tokens:
                    stamps[i].append(time.monotonic())

    streams = [threading.Thread(target=stream, args=(i,)) for i in (0, 1)]
    for t in streams:
        t.start()
    while min(len(s) for s in stamps.values()) < 3:  # both are decoding
        time.sleep(0.05)
    regex = slow_regex()
    sent = time.monotonic()
    slow: list[float] = []
    params = pb.Parameters(stopping=pb.StoppingParameters(max_new_tokens=8), constraint=pb.Constraint(regex=regex))
    text = ""
    for msg in smol_server.stub.GenerateStream(pb.GenerateStreamRequest(text="Go:", parameters=params), timeout=300):
        slow.append(time.monotonic())
        text += msg.text
    for call in calls:
        call.cancel()
    for t in streams:
        t.join()
    compiling = slow[0] - sent  # the slow request waited this long for its grammar, then its first token
    assert compiling > 1.0, f"the grammar compiled in {compiling:.2f} s: too fast to show anything"
    prefix = regex[:9]  # its unique literal start, then [a-n]{1,300}...
    assert text.startswith(prefix) or prefix.startswith(text), text
    gaps = [b - a for s in stamps.values() for a, b in itertools.pairwise(s) if sent <= b <= slow[0]]
    assert len(gaps) >= 4, (compiling, gaps)
    # compiled on the step loop, one gap would be as long as the compile itself
    assert max(gaps) < compiling / 3, (compiling, max(gaps))
    metrics = scrape(smol_server)
    assert metrics["loom_grammar_compile_seconds_count"] >= 1
    assert metrics['loom_constrained_requests_total{kind=regex}'] >= 1


def test_metrics_count_constrained_requests_and_cache_hits(smol_server: ServerProcess) -> None:
    before = scrape(smol_server)
    for _ in range(2):
        generate(smol_server, "Pick", pb.Constraint(choice=pb.Choice(choices=["red", "blue"])), max_new=4)
    after = scrape(smol_server)
    assert after['loom_constrained_requests_total{kind=choice}'] - before['loom_constrained_requests_total{kind=choice}'] == 2
    assert after["loom_grammar_cache_hits_total"] - before["loom_grammar_cache_hits_total"] >= 1
    assert after["loom_grammar_cache_queries_total"] - before["loom_grammar_cache_queries_total"] == 2


@pytest.fixture(scope="module")
def short_limit_server(tiny_llama_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    # Its matchers in a process of their own (as auto chooses on a GPU): the time limit and the
    # compile cache live there.
    server = start_server(tiny_llama_dir, server_logs, "grammar-timeout", "--max-total-tokens", "1024",
                          "--grammar-compile-timeout", "0.5", "--async-scheduling", "on", "--grammar-process", "on")
    yield server
    server.stop()


def test_the_compile_time_limit_fires(short_limit_server: ServerProcess) -> None:
    server = short_limit_server
    quick = pb.Parameters(stopping=pb.StoppingParameters(max_new_tokens=8), constraint=pb.Constraint(regex="[ab]{2}"))
    reply = server.stub.Generate(pb.GenerateRequest(text="x", parameters=quick), timeout=120)  # also: the vocabulary
    assert re.fullmatch("[ab]{2}", reply.completions[0].text)
    regex = slow_regex(48)
    params = pb.Parameters(constraint=pb.Constraint(regex=regex))
    for attempt in range(2):
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            server.stub.Generate(pb.GenerateRequest(text="x", parameters=params), timeout=120)
        elapsed = time.monotonic() - started
        code, violations, reason = _status(info.value)
        assert code is grpc.StatusCode.INVALID_ARGUMENT and reason == "GRAMMAR_COMPILE_TIMEOUT"
        assert violations[0][0] == "parameters.constraint.regex"
        assert "--grammar-compile-timeout (0.5 s)" in violations[0][1]
        if attempt == 0:
            assert 0.5 <= elapsed < 10
        else:
            assert elapsed < 0.5  # the same text, still compiling: refused at once
    # others are still served while that compile goes on
    again = server.stub.Generate(pb.GenerateRequest(text="y", parameters=quick), timeout=120)
    assert re.fullmatch("[ab]{2}", again.completions[0].text)
    assert scrape(server)["loom_grammar_compile_timeouts_total"] == 2
