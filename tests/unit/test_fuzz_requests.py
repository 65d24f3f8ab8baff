"""Fuzz request validation in-process: any GenerateRequest is either a sound plan or INVALID_ARGUMENT.

Nothing else may come out of validation (an exception there would reach a client as INTERNAL),
and a request that passes must be one the engine can run within the server's limits. The same
strategies drive the real server in tests/e2e/test_fuzz_grpc.py.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from helpers.request_strategies import generate_fields
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loom.frontend.generation import GenerationPlan
from loom.frontend.tokenizer import Tokenizer
from loom.server.errors import FieldViolation, ValidationError
from loom.server.validation import (
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
    RequestLimits,
    as_float32,
    validate_generate,
)
from loom_client.v1 import generation_pb2 as pb

LIMITS = RequestLimits(max_input_tokens=1000, max_total_tokens=1024, vocab_size=49152, max_stop_sequences=4,
                       max_top_n_tokens=5, max_best_of=2, default_max_new_tokens=256, max_input_chars=262_144)


@pytest.fixture(scope="module")
def tok(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(default_model_dir)


def check_plan(plan: GenerationPlan, streaming: bool) -> None:
    req = plan.engine_request
    prompt = len(req.prompt_token_ids)
    assert 1 <= prompt <= LIMITS.max_input_tokens
    assert all(0 <= t < LIMITS.vocab_size for t in req.prompt_token_ids)
    assert 1 <= req.stopping.max_new_tokens <= LIMITS.max_total_tokens - prompt
    assert req.stopping.min_new_tokens <= req.stopping.max_new_tokens
    assert all(0 <= t < LIMITS.vocab_size for t in req.stopping.stop_token_ids)
    assert 1 <= plan.n <= plan.best_of <= LIMITS.max_best_of
    assert not (streaming and plan.best_of > plan.n)
    s = req.sampling
    for value in (s.temperature, s.top_p, s.typical_p, s.min_p, s.repetition_penalty, s.frequency_penalty,
                  s.presence_penalty):
        assert math.isfinite(value)
    assert 0 < s.top_p <= 1 and 0 < s.typical_p <= 1 and 0 <= s.min_p < 1
    # the ranges in which no processed logit can overflow
    assert s.temperature >= as_float32(MIN_TEMPERATURE)
    assert as_float32(MIN_REPETITION_PENALTY) <= s.repetition_penalty <= MAX_REPETITION_PENALTY
    assert s.top_n_tokens <= LIMITS.max_top_n_tokens
    assert plan.time_limit_s is None or plan.time_limit_s > 0
    assert len(plan.text.stop_sequences) <= LIMITS.max_stop_sequences and all(plan.text.stop_sequences)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                                   HealthCheck.function_scoped_fixture])
@given(fields=generate_fields(), streaming=st.booleans())
def test_validation_accepts_sound_plans_or_names_fields(tok: Tokenizer, fields: dict[str, Any], streaming: bool) -> None:
    request = pb.GenerateStreamRequest(**fields) if streaming else pb.GenerateRequest(**fields)
    try:
        plan = validate_generate(request, "fuzz", tok, LIMITS, streaming)
    except ValidationError as exc:
        assert exc.violations and all(v.field and v.description for v in exc.violations)
        assert exc.to_grpc_status().code.name == "INVALID_ARGUMENT"
        return
    check_plan(plan, streaming)


def test_a_status_with_many_violations_stays_small(tok: Tokenizer) -> None:
    """Trailing metadata is capped (8 KiB by default): the status must fit whatever the request, and
    a repeated field's violations are one, naming its first bad element and how many there are."""
    request = pb.GenerateRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(role="r" * 4000, content="x") for _ in range(50)]),
        parameters=pb.Parameters(stopping=pb.StoppingParameters(stop_sequences=[""] * 1000,
                                                                stop_token_ids=list(range(49152, 149152)))),
    )
    with pytest.raises(ValidationError) as info:
        validate_generate(request, "fuzz", tok, LIMITS, False)
    status = info.value.to_grpc_status()
    size = len(status.details) + sum(len(str(k)) + len(v) for k, v in status.trailing_metadata)
    assert size < 4096, size
    assert [v.field for v in info.value.violations] == [
        "chat.messages[0].role", "parameters.stopping.stop_sequences", "parameters.stopping.stop_sequences[0]",
        "parameters.stopping.stop_token_ids", "parameters.stopping.stop_token_ids[0]"]
    assert "(50 messages with an unknown role in all)" in info.value.violations[0].description
    assert "(1000 empty ones in all)" in info.value.violations[2].description
    assert info.value.omitted == 0


def _status_reaching_a_client(error: ValidationError) -> grpc.aio.AioRpcError:
    """The error a real gRPC client sees when a handler aborts with ``error``'s status."""
    async def handler(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        await context.abort_with_status(error.to_grpc_status())
        raise AssertionError("unreachable")

    async def main() -> grpc.aio.AioRpcError:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "test.Svc", {"Fail": grpc.unary_unary_rpc_method_handler(handler)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await channel.unary_unary("/test.Svc/Fail")(b"", timeout=10)
                return info.value
        finally:
            await server.stop(0)

    return asyncio.run(main())


def test_any_number_of_violations_reaches_a_client_as_invalid_argument() -> None:
    """Hundreds of violations whose text is all 4-byte characters (3 wire bytes per byte in
    grpc-message): the client still gets INVALID_ARGUMENT with a BadRequest, not a transport error
    for metadata past its limit; what does not fit is counted in the message."""
    violations = [FieldViolation(f"field_{i}", "\U0001f600" * 300) for i in range(500)]
    err = _status_reaching_a_client(ValidationError(violations))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None
    bad = error_details_pb2.BadRequest()
    assert any(d.Unpack(bad) for d in status.details)
    listed = [v.field for v in bad.field_violations]
    assert listed == [f"field_{i}" for i in range(len(listed))] and len(listed) >= 3
    assert (err.details() or "").endswith(f"(and {500 - len(listed)} more violations, too many to list)")


def test_unknown_roles_quoted_back_reach_a_client_as_invalid_argument(tok: Tokenizer) -> None:
    """A real request of that kind: a chat whose roles are long runs of 4-byte characters."""
    request = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="\U0001f600" * 1000, content="x")] * 10))
    with pytest.raises(ValidationError) as info:
        validate_generate(request, "fuzz", tok, LIMITS, False)
    err = _status_reaching_a_client(info.value)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert (err.details() or "").startswith("chat.messages[0].role: unknown role")
