"""Fuzz the real server: whatever GenerateRequest arrives, the answer is OK or INVALID_ARGUMENT.

Never UNKNOWN, INTERNAL or a transport error: a client's mistake must be named as one, and
nothing a client sends may break the server. Fewer examples than the in-process fuzz of
validation (tests/unit/test_fuzz_requests.py), through both RPCs. The server's budget is small
(--max-total-tokens 64) so that requests which pass validation stay quick.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from helpers.request_strategies import generate_fields
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from loom.server.validation import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY, MIN_TEMPERATURE
from loom_client.v1 import generation_pb2 as pb

from .server_process import ServerProcess, start_server

pytestmark = pytest.mark.e2e

ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}
SEEN: Counter[str] = Counter()


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    server = start_server(tiny_llama_dir, server_logs, "fuzz", "--max-total-tokens", "64", "--max-input-tokens", "48",
                          "--default-max-new-tokens", "8", "--max-batch-total-tokens", "8192")
    yield server
    server.stop()


def answer(server: ServerProcess, fields: dict[str, Any], streaming: bool) -> tuple[grpc.StatusCode, str]:
    try:
        if streaming:
            for _ in server.stub.GenerateStream(pb.GenerateStreamRequest(**fields), timeout=60):
                pass
        else:
            server.stub.Generate(pb.GenerateRequest(**fields), timeout=60)
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


def _params(**kw: Any) -> pb.Parameters:
    return pb.Parameters(**kw)


# Cases found worth pinning: extremes that pass validation must still generate. (The next two
# once passed and overflowed the logits; they are INVALID_ARGUMENT now: see the test after this.)
@example(fields={"text": "Hi", "parameters": _params(n=2, sampling=pb.SamplingParameters(do_sample=True, seed=2**64 - 1))},
         streaming=False)
@example(fields={"text": "Hi", "parameters": _params(sampling=pb.SamplingParameters(temperature=1e-45, top_k=2**32 - 1))},
         streaming=True)
@example(fields={"text": "Hi", "parameters": _params(penalties=pb.PenaltyParameters(repetition_penalty=3.4e38))},
         streaming=False)
@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(fields=generate_fields(), streaming=st.booleans())
def test_only_ok_or_invalid_argument(fuzz_server: ServerProcess, fields: dict[str, Any], streaming: bool) -> None:
    code, details = answer(fuzz_server, fields, streaming)
    SEEN[code.name] += 1
    assert code in ALLOWED, f"{code.name}: {details}"


@pytest.mark.parametrize("edge", [
    pb.Parameters(sampling=pb.SamplingParameters(temperature=MIN_TEMPERATURE, top_p=0.5),
                  penalties=pb.PenaltyParameters(repetition_penalty=MIN_REPETITION_PENALTY, frequency_penalty=-2)),
    pb.Parameters(sampling=pb.SamplingParameters(temperature=MIN_TEMPERATURE, min_p=0.5),
                  penalties=pb.PenaltyParameters(repetition_penalty=MAX_REPETITION_PENALTY, presence_penalty=2)),
], ids=["lowest-penalty", "highest-penalty"])
def test_the_edges_of_the_ranges_that_keep_logits_finite_generate(fuzz_server: ServerProcess,
                                                                   edge: pb.Parameters) -> None:
    """The smallest temperature with the smallest and largest repetition penalty: a success with
    finite logprobs, not an error (nor garbage reported as success)."""
    edge.stopping.max_new_tokens, edge.stopping.ignore_eos = 8, True
    edge.response.logprobs, edge.response.top_n_tokens = True, 5
    reply = fuzz_server.stub.Generate(pb.GenerateRequest(text="Hi Hi Hi Hi", parameters=edge), timeout=60)
    tokens = reply.completions[0].tokens
    assert len(tokens) == 8
    for t in tokens:
        assert math.isfinite(t.logprob) and t.logprob <= 0
        assert t.top_tokens and all(math.isfinite(a.logprob) for a in t.top_tokens)


def test_server_is_still_serving_after_the_fuzz(fuzz_server: ServerProcess) -> None:
    assert fuzz_server.health_status() == "SERVING"
    # Both outcomes really occurred: the fuzz reached generation, not only validation.
    assert SEEN["OK"] > 5 and SEEN["INVALID_ARGUMENT"] > 5, SEEN
    reply = fuzz_server.stub.Generate(pb.GenerateRequest(text="Hello", parameters=pb.Parameters(
        stopping=pb.StoppingParameters(max_new_tokens=4, ignore_eos=True))), timeout=30)
    assert reply.completions[0].generated_tokens == 4
