"""Speculative decoding through the real engine (tiny Llama, CPU): outputs equal those without
speculation, token for token (greedy, seeded sampling, penalties, n > 1), under batching,
preemption and prefix hits; drafts are accepted and rejected as the model decides; KV blocks
all come back; and the n-gram proposer finds what it should."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.oracle_proposer import LIES, REFERENCE, registry

from loom.config import ConfigError, EngineConfig
from loom.engine.llm_engine import LLMEngine
from loom.engine.types import EngineOutput, EngineRequest, FinishReason, SamplingParams, StoppingParams
from loom.plugin_api import DraftRequest, ProposerContext
from loom_plugins.speculative.ngram import NgramProposer


@pytest.fixture(scope="module")
def plain_engine(engine_on: Callable[..., LLMEngine]) -> LLMEngine:
    return engine_on()


@pytest.fixture(scope="module")
def oracle_engine(engine_on: Callable[..., LLMEngine]) -> LLMEngine:
    return engine_on(speculate=4, speculator="oracle")


@pytest.fixture(scope="module")
def engine_on(tiny_model_dir: Callable[[str], Path]) -> Callable[..., LLMEngine]:
    path = tiny_model_dir("llama")

    def make(**kw: Any) -> LLMEngine:
        return LLMEngine(EngineConfig(model_id=str(path), block_size=4, **kw), registry())

    return make


def run(engine: LLMEngine, requests: list[EngineRequest]) -> tuple[dict[tuple[str, int], list[int]],
                                                                    dict[tuple[str, int], list[float]],
                                                                    list[EngineOutput]]:
    tokens: dict[tuple[str, int], list[int]] = {}
    logprobs: dict[tuple[str, int], list[float]] = {}
    outs: list[EngineOutput] = []
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished():
        for o in engine.step():
            outs.append(o)
            tokens.setdefault((o.request_id, o.index), []).extend(o.token_ids)
            logprobs.setdefault((o.request_id, o.index), []).extend(o.logprobs)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # every block back
    return tokens, logprobs, outs


def teach_oracle(ref: dict[tuple[str, int], list[int]], reqs: list[EngineRequest]) -> None:
    """The oracle proposer's answers: each request's tokens from a run without drafts."""
    REFERENCE.clear()
    for r in reqs:
        REFERENCE[r.prompt_token_ids] = ref[(r.request_id, 0)]


def _requests(draw: int, count: int = 6, **sampling: Any) -> list[EngineRequest]:
    rng = random.Random(draw)
    reqs = []
    for i in range(count):
        prompt = tuple(rng.randrange(3, 200) for _ in range(rng.randint(3, 20)))
        stopping = StoppingParams(max_new_tokens=rng.randint(5, 24), min_new_tokens=rng.choice([0, 3]),
                                  ignore_eos=bool(i % 2))
        reqs.append(EngineRequest(f"r{i}", prompt, SamplingParams(**sampling), stopping, n=1 + (i == 2)))
    return reqs


@pytest.mark.parametrize("lie_rate", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("sampling", [
    {},
    {"do_sample": True, "seed": 7, "temperature": 0.8, "top_k": 20, "top_p": 0.9},
    {"do_sample": True, "seed": 3, "repetition_penalty": 1.3, "frequency_penalty": 0.4, "min_p": 0.05},
    {"top_n_tokens": 3},
])
def test_outputs_equal_those_without_speculation(plain_engine: LLMEngine, oracle_engine: LLMEngine,
                                                 lie_rate: float, sampling: dict[str, Any]) -> None:
    """Whatever the drafts (all right, some wrong, all wrong), every completion's tokens and
    logprobs equal the run without speculation: greedy, seeded sampling (the coupled noise of
    loom.sample.verify) and penalties over the drafts."""
    ref_tokens, ref_lps, _ = run(plain_engine, _requests(1, **sampling))
    teach_oracle(ref_tokens, _requests(1, **sampling))
    LIES["rate"] = lie_rate
    tokens, lps, outs = run(oracle_engine, _requests(1, **sampling))
    assert tokens == ref_tokens
    for key, values in lps.items():
        assert values == pytest.approx(ref_lps[key], abs=1e-4)
    drafts = sum(o.num_draft_tokens for o in outs)
    accepted = sum(o.num_accepted_draft_tokens for o in outs)
    assert drafts > 0
    if lie_rate == 0.0:
        # the truth is accepted, except where a request's second completion (its own seed) differs
        assert accepted >= 0.8 * drafts if "seed" in sampling else accepted == drafts
        assert max(len(o.token_ids) for o in outs) > 2  # several tokens a step
    if lie_rate == 1.0:
        assert accepted < 0.1 * drafts


@pytest.mark.parametrize("lie_rate", [0.0, 0.5])
def test_uniform_cuda_steps_with_filler_equal_those_without_speculation(plain_engine: LLMEngine,
                                                                       engine_on: Callable[..., LLMEngine],
                                                                       lie_rate: float) -> None:
    """The CUDA step shape on the CPU (pad_to_k): every decode row of a verifying step verifies k
    tokens, sequences near their max_new_tokens included (filler past the limit, never output),
    and the outputs, the lengths and the KV blocks are those of the run without speculation."""
    reqs = _requests(5, count=8, top_n_tokens=2)
    ref_tokens, ref_lps, _ = run(plain_engine, reqs)
    teach_oracle(ref_tokens, reqs)
    LIES["rate"] = lie_rate
    engine = engine_on(speculate=4, speculator="oracle")
    assert engine.speculator is not None
    engine.speculator.pad_to_k = True
    steps: list[tuple[list[bool], list[int]]] = []  # per step: which rows decode, their widths
    schedule = engine.scheduler.schedule

    def recording() -> Any:
        out = schedule()
        decoding = [q.num_output_tokens > 0 and n == 1 for q, n in zip(out.seqs, out.num_new_tokens, strict=True)]
        steps.append((decoding, out.num_new_tokens))  # the speculator widens the rows in place afterwards
        return out

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    tokens, lps, outs = run(engine, reqs)
    assert tokens == ref_tokens
    for key, values in lps.items():
        assert values == pytest.approx(ref_lps[key], abs=1e-4)
    assert all(len(tokens[(r.request_id, 0)]) <= r.stopping.max_new_tokens for r in reqs)
    # a step of decode rows only (mixed steps run eagerly anyway) in which some row verifies is
    # uniform, rows a few tokens from their max_new_tokens included
    verifying = [w for dec, w in steps if all(dec) and max(w) > 1]
    assert verifying and all(set(w) == {5} for w in verifying), [w for w in verifying if set(w) != {5}][:3]
    assert engine.speculator.counters.filler_tokens > 0
    # usage counts the proposer's drafts only: the filler is neither proposed nor accepted there
    c = engine.speculator.counters
    assert sum(o.num_draft_tokens for o in outs) == c.draft_tokens
    assert sum(o.num_accepted_draft_tokens for o in outs) <= c.accepted_tokens <= c.draft_tokens


def test_stops_and_limits_inside_an_accepted_run(engine_on: Callable[..., LLMEngine]) -> None:
    """max_new_tokens is never exceeded, and an EOS / stop id accepted among the drafts ends the
    output there, as without speculation."""
    plain = engine_on()
    prompt = (5, 6, 7, 8)
    free_run, _, _ = run(plain, [EngineRequest("x", prompt, SamplingParams(),
                                               StoppingParams(max_new_tokens=12, ignore_eos=True))])
    stop_at = free_run[("x", 0)][6]
    reqs = [EngineRequest("len", prompt, SamplingParams(), StoppingParams(max_new_tokens=9, ignore_eos=True)),
            EngineRequest("stop", prompt, SamplingParams(), StoppingParams(max_new_tokens=12, ignore_eos=True,
                                                                          stop_token_ids=(stop_at,)))]
    ref, _, _ref_outs = run(engine_on(), reqs)
    REFERENCE.clear()
    REFERENCE[prompt] = free_run[("x", 0)]
    LIES["rate"] = 0.0
    got, _, outs = run(engine_on(speculate=5, speculator="oracle"), reqs)
    assert got == ref
    assert len(got[("len", 0)]) == 9
    assert got[("stop", 0)][-1] == stop_at and len(got[("stop", 0)]) == free_run[("x", 0)].index(stop_at) + 1
    reasons = {o.request_id: o.finish_reason for o in outs if o.finished}
    assert reasons == {"len": FinishReason.LENGTH, "stop": FinishReason.STOP_SEQUENCE}


def test_preemption_and_prefix_hits_with_speculation(engine_on: Callable[..., LLMEngine]) -> None:
    """A pool too small for the batch (preemptions, drafts skipped for want of slots) and shared
    prompts (prefix-cache hits on blocks that only verified tokens fill) change nothing."""
    shared = tuple(range(10, 30))
    reqs = [EngineRequest(f"p{i}", (*shared, 40 + i), SamplingParams(),
                          StoppingParams(max_new_tokens=30, ignore_eos=True)) for i in range(6)]
    ref, _, _ = run(engine_on(), reqs)
    teach_oracle(ref, reqs)
    LIES["rate"] = 0.3
    spec = engine_on(speculate=4, speculator="oracle", max_batch_total_tokens=160)
    got, _, _ = run(spec, reqs)
    assert got == ref
    assert spec.scheduler.num_preemptions > 0
    assert spec.block_manager.stats.hits > 0


def test_speculation_steps_aside_above_the_batch_limit(engine_on: Callable[..., LLMEngine]) -> None:
    reqs = _requests(4, count=5)
    ref, _, _ = run(engine_on(), reqs)
    teach_oracle(ref, reqs)
    LIES["rate"] = 0.0
    spec = engine_on(speculate=3, speculator="oracle", speculate_max_batch_size=2)
    got, _, outs = run(spec, reqs)
    assert got == ref
    # drafts only in steps where at most 2 sequences ran (the tail of the run)
    assert spec.speculator is not None and spec.speculator.counters.steps > 0
    assert all(len(o.token_ids) <= 4 for o in outs)


def test_steps_where_every_sequence_rests_stay_asynchronous(engine_on: Callable[..., LLMEngine]) -> None:
    """Drafts that are always wrong: each sequence backs off (4, 8, ... steps); steps in which no
    sequence is due to propose are launched while the previous one is in flight, and count for
    the back-off, which ends: speculation resumes. Outputs are those without speculation."""
    reqs = [EngineRequest(f"r{i}", tuple(range(3 + i, 40 + i)), SamplingParams(),
                          StoppingParams(max_new_tokens=60, ignore_eos=True)) for i in range(2)]
    ref, _, _ = run(engine_on(), reqs)
    teach_oracle(ref, reqs)
    LIES["rate"] = 1.0
    try:
        spec = engine_on(speculate=3, speculator="oracle", async_scheduling="on")
        got, _, _ = run(spec, reqs)
    finally:
        LIES["rate"] = 0.0
    assert got == ref
    assert spec.speculator is not None
    c = spec.speculator.counters
    assert c.draft_tokens > 0 and c.accepted_tokens == 0
    assert spec.num_async_steps > 20  # the resting steps overlapped
    assert c.verifications > 2 * len(reqs)  # each sequence tried again after its back-off


def test_a_request_can_turn_speculation_off(engine_on: Callable[..., LLMEngine]) -> None:
    reqs = _requests(5, count=2)
    ref, _, _ = run(engine_on(), reqs)
    teach_oracle(ref, reqs)
    LIES["rate"] = 0.0
    off = [EngineRequest(r.request_id, r.prompt_token_ids, SamplingParams(speculate=False), r.stopping, n=r.n)
           for r in reqs]
    got, _, outs = run(engine_on(speculate=3, speculator="oracle"), off)
    assert got == ref and all(o.num_draft_tokens == 0 for o in outs)


def test_unknown_speculator_and_bad_options_fail_at_start(engine_on: Callable[..., LLMEngine]) -> None:
    from loom.preflight import check_engine_config

    with pytest.raises(ConfigError, match="--speculator"):
        check_engine_config(EngineConfig(speculate=2, speculator="nope"), registry())
    with pytest.raises(ConfigError, match="max_n"):
        check_engine_config(EngineConfig(speculate=2, speculator_options=(("max_n", "0"),)), registry())
    with pytest.raises(ConfigError, match="unknown option"):
        check_engine_config(EngineConfig(speculate=2, speculator_options=(("window", "3"),)), registry())
    with pytest.raises(ConfigError, match="--speculate"):
        EngineConfig(speculate=-1)


# -- the n-gram proposer --------------------------------------------------------------------------
def _ngram(**options: str) -> NgramProposer:
    return NgramProposer(ProposerContext(num_speculative_tokens=4, vocab_size=1000, device="cpu", dtype="float32",
                                         options=options))


def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    p = _ngram(min_n="1", max_n="3")
    #          0  1  2  3  4  5  6  7  8  9 10
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 1, 2, 3]
    # suffix (1,2,3) last occurred ending at 8 (followed by 4, 5, 1 ...)
    assert p.propose([DraftRequest(0, tokens, 3)]) == [[4, 5, 1]]
    assert p.propose([DraftRequest(0, tokens, 1)]) == [[4]]
    # the index grows with the sequence: after 7, the 1-gram (7,) has no earlier occurrence
    assert p.propose([DraftRequest(0, [*tokens, 7], 3)]) == [[]]
    assert p.propose([DraftRequest(0, [*tokens, 7, 1, 2, 3, 4], 2)]) == [[5, 1]]
    p.release(0)
    assert p.propose([DraftRequest(0, [5, 6], 2)]) == [[]]


def test_ngram_prefers_the_longest_match_over_a_later_short_one() -> None:
    p = _ngram(min_n="1", max_n="2")
    tokens = [4, 5, 6, 8, 5, 7, 4, 5]
    # (4, 5) occurred at the start, followed by 6; the later (5,) alone would propose 7
    assert p.propose([DraftRequest(1, tokens, 2)]) == [[6, 8]]


def test_ngram_greedy_on_the_tiny_model_equals_plain(engine_on: Callable[..., LLMEngine]) -> None:
    """The built-in proposer through the engine: a prompt that repeats itself gets drafts, and the
    output is the plain run's."""
    loop = tuple([11, 12, 13, 14, 15] * 4)
    reqs = [EngineRequest("loop", loop, SamplingParams(), StoppingParams(max_new_tokens=24, ignore_eos=True)),
            EngineRequest("other", (7, 8, 9), SamplingParams(), StoppingParams(max_new_tokens=10, ignore_eos=True))]
    ref, _, _ = run(engine_on(), reqs)
    spec = engine_on(speculate=3)
    got, _, _ = run(spec, reqs)
    assert got == ref
    assert spec.speculator is not None and spec.speculator.counters.draft_tokens > 0


def test_draft_model_proposer_equals_plain_and_keeps_its_kv_in_step(engine_on: Callable[..., LLMEngine],
                                                                    tiny_model_dir: Callable[[str], Path]) -> None:
    """The target as its own draft model: every greedy draft is accepted (the same weights in
    fp32), the outputs are the plain run's, and the draft's KV blocks all come back."""
    reqs = _requests(6, count=4)
    ref, _, _ = run(engine_on(), reqs)
    spec = engine_on(speculate=3, speculator="draft",
                     speculator_options=(("model_id", str(tiny_model_dir("llama"))), ("kv_tokens", "2048")))
    got, _, _outs = run(spec, reqs)
    assert got == ref
    assert spec.speculator is not None
    c = spec.speculator.counters
    assert c.draft_tokens > 0 and c.accepted_tokens >= 0.9 * c.draft_tokens
    proposer = spec.speculator.proposer
    assert proposer.num_free_blocks == proposer.num_blocks  # type: ignore[attr-defined]


def test_draft_model_options_are_checked() -> None:
    from loom_plugins.speculative.draft_model import DraftModelProposer

    with pytest.raises(ValueError, match="model_id"):
        DraftModelProposer.check_options({})
    with pytest.raises(ValueError, match="unknown option"):
        DraftModelProposer.check_options({"model_id": "x", "temperature": "1"})
