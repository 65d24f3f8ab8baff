"""Generation parameters through the real server: seeds, finish reasons, min_new_tokens, logprobs."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from loom_client.v1 import generation_pb2 as pb

from .server_process import ServerProcess, start_server

pytestmark = pytest.mark.e2e

SEEDED = pb.Parameters(
    sampling=pb.SamplingParameters(do_sample=True, temperature=1.2, top_k=100, top_p=0.95, seed=1234),
    stopping=pb.StoppingParameters(max_new_tokens=24, ignore_eos=True),
    response=pb.ResponseParameters(tokens=True),
)


def seeded_ids(server: ServerProcess, text: str = "Once upon a time") -> list[int]:
    resp = server.stub.Generate(pb.GenerateRequest(text=text, parameters=SEEDED), timeout=120)
    assert resp.completions[0].seed == 1234
    return [t.id for t in resp.completions[0].tokens]


def test_seeded_sampling_is_reproducible_across_batches_and_restarts(
        tiny_server: ServerProcess, tiny_llama_dir: Path, server_logs: Path) -> None:
    alone = seeded_ids(tiny_server)
    assert len(alone) == 24
    # the same request inside a crowd of other sampled and greedy requests
    others = [pb.GenerateRequest(text=f"noise {i} " * (i + 1), parameters=pb.Parameters(
        sampling=pb.SamplingParameters(do_sample=i % 2 == 0, seed=i),
        stopping=pb.StoppingParameters(max_new_tokens=10 + i, ignore_eos=True))) for i in range(12)]
    with ThreadPoolExecutor(max_workers=13) as pool:
        noise = [pool.submit(tiny_server.stub.Generate, r, timeout=120) for r in others]
        crowded = pool.submit(seeded_ids, tiny_server)
        assert crowded.result() == alone
        for f in noise:
            f.result()
    # a fresh server process: same weights, same seed, same tokens
    fresh = start_server(tiny_llama_dir, server_logs, "tiny-restart", "--max-total-tokens", "1024")
    try:
        assert seeded_ids(fresh) == alone
    finally:
        fresh.stop()


def test_unseeded_request_reports_the_seed_that_reproduces_it(tiny_server: ServerProcess) -> None:
    params = pb.Parameters(sampling=pb.SamplingParameters(do_sample=True),
                           stopping=pb.StoppingParameters(max_new_tokens=12, ignore_eos=True),
                           response=pb.ResponseParameters(tokens=True))
    first = tiny_server.stub.Generate(pb.GenerateRequest(text="hello", parameters=params), timeout=60).completions[0]
    assert first.HasField("seed")
    params.sampling.seed = first.seed
    again = tiny_server.stub.Generate(pb.GenerateRequest(text="hello", parameters=params), timeout=60).completions[0]
    assert [t.id for t in again.tokens] == [t.id for t in first.tokens]


def test_each_finish_reason(tiny_server: ServerProcess) -> None:
    def finish(**stopping: object) -> pb.Completion:
        params = pb.Parameters(stopping=pb.StoppingParameters(**stopping), response=pb.ResponseParameters(tokens=True))  # type: ignore[arg-type]
        return tiny_server.stub.Generate(pb.GenerateRequest(text="The weather", parameters=params),
                                         timeout=60).completions[0]

    free = finish(max_new_tokens=6, ignore_eos=True)
    assert free.finish_reason == pb.FINISH_REASON_LENGTH and free.generated_tokens == 6
    stop_id = free.tokens[2].id
    by_token = finish(max_new_tokens=6, ignore_eos=True, stop_token_ids=[stop_id])
    assert by_token.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
    assert [t.id for t in by_token.tokens] == [t.id for t in free.tokens][: [t.id for t in free.tokens].index(stop_id) + 1]
    stop_text = free.text[len(free.text) // 2 : len(free.text) // 2 + 3]
    if stop_text.strip():
        by_text = finish(max_new_tokens=6, ignore_eos=True, stop_sequences=[stop_text])
        assert by_text.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
        assert by_text.text == free.text[: free.text.index(stop_text)]
    slow = finish(max_new_tokens=1000, ignore_eos=True, time_limit_ms=50)
    assert slow.finish_reason == pb.FINISH_REASON_TIME_LIMIT and slow.generated_tokens < 1000


def test_min_new_tokens_holds_back_eos(smol_server: ServerProcess) -> None:
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="What is the capital of France?")])
    short = smol_server.stub.Generate(pb.GenerateRequest(chat=chat, parameters=pb.Parameters(
        stopping=pb.StoppingParameters(max_new_tokens=48))), timeout=120).completions[0]
    assert short.finish_reason == pb.FINISH_REASON_EOS_TOKEN and short.generated_tokens < 20
    held = smol_server.stub.Generate(pb.GenerateRequest(chat=chat, parameters=pb.Parameters(
        stopping=pb.StoppingParameters(max_new_tokens=48, min_new_tokens=20),
        response=pb.ResponseParameters(tokens=True))), timeout=120).completions[0]
    assert held.generated_tokens >= 20
    assert all(t.id != 2 for t in held.tokens[:19])  # no EOS before min_new_tokens


def test_logprobs_under_temperature_and_top_p_are_taken_before_filtering(smol_server: ServerProcess) -> None:
    """The README's GenerateStream example (temperature 0.8, top_p 0.95): each token's logprob is
    finite and below 0 (it read 0 whenever top_p left a single candidate), and every alternative
    is a kept token on the same distribution (never a filtered one at -3.4e38)."""
    params = pb.Parameters(sampling=pb.SamplingParameters(temperature=0.8, top_p=0.95, seed=7),
                           stopping=pb.StoppingParameters(max_new_tokens=64, stop_sequences=["\n\n"]),
                           response=pb.ResponseParameters(tokens=True, logprobs=True, top_n_tokens=5))
    stream = smol_server.stub.GenerateStream(pb.GenerateStreamRequest(text="Once upon a time", parameters=params),
                                             timeout=120)
    tokens = [t for msg in stream for t in msg.tokens]
    assert len(tokens) > 8
    for t in tokens:
        assert t.HasField("logprob") and math.isfinite(t.logprob) and t.logprob < 0, t
        alternatives = [(a.id, a.logprob) for a in t.top_tokens]
        assert 1 <= len(alternatives) <= 5
        assert all(-1e30 < lp < 0 for _, lp in alternatives), alternatives
        assert [lp for _, lp in alternatives] == sorted((lp for _, lp in alternatives), reverse=True)
        listed = dict(alternatives)
        if t.id in listed:
            assert listed[t.id] == t.logprob
        else:  # a less likely token was drawn; it was kept, so the list holds five
            assert len(alternatives) == 5 and t.logprob <= alternatives[-1][1]


def test_sampled_logprobs_equal_the_model_logprobs_of_the_same_text(smol_server: ServerProcess) -> None:
    """A reference from the model's own logits: at temperature 1 with top_p, each sampled token's
    logprob is the log_softmax of the unfiltered logits, i.e. its prompt logprob when the prompt
    and the completion are sent back as one prompt."""
    params = pb.Parameters(sampling=pb.SamplingParameters(temperature=1.0, top_p=0.8, seed=3),
                           stopping=pb.StoppingParameters(max_new_tokens=16, ignore_eos=True),
                           response=pb.ResponseParameters(logprobs=True, prompt_logprobs=True))
    first = smol_server.stub.Generate(pb.GenerateRequest(text="The weather today is", parameters=params), timeout=120)
    prompt = [t.id for t in first.prompt_tokens]
    sampled = first.completions[0].tokens
    again = smol_server.stub.Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt + [t.id for t in sampled]),
        parameters=pb.Parameters(stopping=pb.StoppingParameters(max_new_tokens=1),
                                 response=pb.ResponseParameters(prompt_logprobs=True))), timeout=120)
    reference = [t.logprob for t in again.prompt_tokens[len(prompt):]]
    assert len(reference) == len(sampled) == 16
    assert [t.logprob for t in sampled] == pytest.approx(reference, abs=2e-3)
