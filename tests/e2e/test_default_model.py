"""The embedded default model (SmolLM2-135M-Instruct) answers through the real server."""

from __future__ import annotations

import json

import pytest

from loom_client.v1 import generation_pb2 as pb

from .server_process import ServerProcess

pytestmark = pytest.mark.e2e

QUESTION = pb.Chat(messages=[pb.ChatMessage(role="user", content="What is the capital of France?")])
GREEDY = pb.Parameters(stopping=pb.StoppingParameters(max_new_tokens=48))


def test_capital_of_france_names_paris(smol_server: ServerProcess) -> None:
    resp = smol_server.stub.Generate(pb.GenerateRequest(chat=QUESTION, parameters=GREEDY), timeout=120)
    answer = resp.completions[0]
    assert "Paris" in answer.text, answer.text
    assert answer.finish_reason == pb.FINISH_REASON_EOS_TOKEN
    assert "<|im_end|>" not in answer.text


def test_stream_matches_unary_and_logs_are_json(smol_server: ServerProcess) -> None:
    unary = smol_server.stub.Generate(pb.GenerateRequest(chat=QUESTION, parameters=GREEDY), timeout=120)
    msgs = list(smol_server.stub.GenerateStream(pb.GenerateStreamRequest(request_id="smol-stream", chat=QUESTION,
                                                                         parameters=GREEDY), timeout=120))
    assert "".join(m.text for m in msgs) == unary.completions[0].text
    info = smol_server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.has_chat_template and info.vocab_size == 49152
    from loom_plugins.quant.gguf import kernel_available

    # on the CPU the GGUF file's blocks serve, and the model info says which plugin does it
    quantizers = [(p.name, p.distribution) for p in info.plugins if p.kind == "quantizer"]
    assert quantizers == ([("gguf", "loom-server")] if kernel_available() else [])
    lines = [json.loads(line) for line in smol_server.log_text().splitlines() if line.startswith("{")]
    mine = [entry for entry in lines if entry.get("request_id") == "smol-stream"]
    assert {e["event"] for e in mine} >= {"request admitted", "request finished"}
