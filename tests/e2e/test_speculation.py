"""Speculative decoding through a real server on the real SmolLM2 (``--speculate 4``, n-gram):
a request that copies a passage gets its drafts accepted, and its output is the very output of
the same request with speculation turned off (``parameters.speculation = false``); Usage and
/metrics report the drafts."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from loom_client.v1 import generation_pb2 as pb

from .server_process import ServerProcess, start_server

pytestmark = pytest.mark.e2e

PASSAGE = ("The committee met on Tuesday to review the proposal for the new library wing. The architect "
           "presented three options: a glass reading room facing the park, a two-storey extension along the "
           "north wall, and a smaller renovation of the existing basement.")
COPY = pb.Chat(messages=[pb.ChatMessage(role="user", content=(
    "Repeat the following passage exactly, word for word, and nothing else.\n\n" + PASSAGE))])


@pytest.fixture(scope="module")
def spec_server(default_model_dir: Path, server_logs: Path) -> Iterator[ServerProcess]:
    server = start_server(None, server_logs, "speculate", "--max-batch-total-tokens", "8192", "--speculate", "4")
    yield server
    server.stop()


def _metric(server: ServerProcess, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_copying_output_is_the_same_and_drafts_are_accepted(spec_server: ServerProcess) -> None:
    params = pb.Parameters(stopping=pb.StoppingParameters(max_new_tokens=80),
                           response=pb.ResponseParameters(logprobs=True))
    off = pb.Parameters()
    off.CopyFrom(params)
    off.speculation = False
    drafts_before = _metric(spec_server, "loom_speculative_draft_tokens_total")
    plain = spec_server.stub.Generate(pb.GenerateRequest(chat=COPY, parameters=off), timeout=300)
    fast = spec_server.stub.Generate(pb.GenerateRequest(chat=COPY, parameters=params), timeout=300)
    assert fast.completions[0].text == plain.completions[0].text
    assert [t.id for t in fast.completions[0].tokens] == [t.id for t in plain.completions[0].tokens]
    assert "library wing" in fast.completions[0].text  # it does copy
    assert plain.usage.draft_tokens == 0
    assert fast.usage.draft_tokens > 0 and fast.usage.accepted_draft_tokens > fast.usage.draft_tokens // 2
    stream = list(spec_server.stub.GenerateStream(pb.GenerateStreamRequest(chat=COPY, parameters=params),
                                                  timeout=300))
    assert "".join(m.text for m in stream) == fast.completions[0].text
    assert stream[-1].usage.accepted_draft_tokens == fast.usage.accepted_draft_tokens
    drafted = _metric(spec_server, "loom_speculative_draft_tokens_total") - drafts_before
    assert drafted == fast.usage.draft_tokens + stream[-1].usage.draft_tokens
    assert _metric(spec_server, "loom_speculative_accepted_tokens_total") >= fast.usage.accepted_draft_tokens
