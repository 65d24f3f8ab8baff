"""Logprobs through the engine equal transformers' processed scores (CPU fp32, within 1e-4).

The distribution reported is the one after penalties and temperature, before top-k / top-p /
typical-p / min-p filtering (as the proto says); tokens are drawn from the filtered one, and the
top-n alternatives are the most likely tokens the filters kept. transformers has no
frequency/presence penalty processor: those are checked against their formula in test_sampler.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.tiny_models import load_hf_reference
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from loom.config import EngineConfig
from loom.engine.llm_engine import LLMEngine
from loom.engine.types import EngineOutput, EngineRequest, SamplingParams, StoppingParams

PROMPT = [5, 17, 42, 99, 3, 250, 17, 8, 64]
TOP_N = 5


# (name, parameters, processors of the reported distribution, the filters that follow them)
CASES: list[tuple[str, SamplingParams, Callable[[], list[Any]], Callable[[], list[Any]]]] = [
    ("greedy", SamplingParams(), lambda: [], lambda: []),
    ("repetition", SamplingParams(repetition_penalty=1.4), lambda: [RepetitionPenaltyLogitsProcessor(1.4)],
     lambda: []),
    ("temperature", SamplingParams(do_sample=True, temperature=0.6, seed=1), lambda: [TemperatureLogitsWarper(0.6)],
     lambda: []),
    ("top_k", SamplingParams(do_sample=True, top_k=7, seed=2), lambda: [], lambda: [TopKLogitsWarper(7)]),
    ("top_k_fewer_than_top_n", SamplingParams(do_sample=True, top_k=2, seed=7), lambda: [],
     lambda: [TopKLogitsWarper(2)]),
    ("top_p", SamplingParams(do_sample=True, top_p=0.7, seed=3), lambda: [], lambda: [TopPLogitsWarper(0.7)]),
    ("typical_p", SamplingParams(do_sample=True, typical_p=0.5, seed=4), lambda: [],
     lambda: [TypicalLogitsWarper(0.5)]),
    ("min_p", SamplingParams(do_sample=True, min_p=0.05, seed=5), lambda: [], lambda: [MinPLogitsWarper(0.05)]),
    ("combined", SamplingParams(do_sample=True, temperature=1.3, top_k=40, top_p=0.9, repetition_penalty=1.2, seed=6),
     lambda: [RepetitionPenaltyLogitsProcessor(1.2), TemperatureLogitsWarper(1.3)],
     lambda: [TopKLogitsWarper(40), TopPLogitsWarper(0.9)]),
]


@pytest.fixture(scope="module")
def setup(tiny_model_dir: Callable[[str], Path]) -> tuple[LLMEngine, Any]:
    path = tiny_model_dir("llama")
    return LLMEngine(EngineConfig(model_id=str(path), block_size=4, max_batch_total_tokens=1024)), load_hf_reference(path)


def generate(engine: LLMEngine, rid: str, sampling: SamplingParams, new: int = 8) -> list[EngineOutput]:
    engine.add_request(EngineRequest(rid, tuple(PROMPT), sampling, StoppingParams(max_new_tokens=new, ignore_eos=True)))
    outs: list[EngineOutput] = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_token_logprobs_match_transformers_processors(setup: tuple[LLMEngine, Any], name: str) -> None:
    engine, hf = setup
    _, sampling, reported_procs, filters = next(c for c in CASES if c[0] == name)
    # Asking for alternatives changes no token: the tokens are those of the same request without.
    outs = generate(engine, name, replace(sampling, top_n_tokens=TOP_N))
    assert [t for o in outs for t in o.token_ids] == [t for o in generate(engine, name + "-plain", sampling)
                                                      for t in o.token_ids]
    tokens = [t for o in outs for t in o.token_ids]
    ours = [lp for o in outs for lp in o.logprobs]
    tops = [top for o in outs for top in (o.top_tokens or [])]
    assert len(tops) == len(tokens)
    reported_list, filter_list = LogitsProcessorList(reported_procs()), LogitsProcessorList(filters())
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + tokens])).logits[0].float()  # [P+N, V]
    for i, tok in enumerate(tokens):
        ids = torch.tensor([PROMPT + tokens[:i]])
        scores = reported_list(ids, logits[len(PROMPT) - 1 + i][None].clone())  # [1, V]
        ref = scores.log_softmax(-1)[0]  # after penalties and temperature, before filtering
        kept = filter_list(ids, scores.clone())[0] > float("-inf")
        assert kept[tok], f"{name}: token {i} was filtered out"
        assert ours[i] == pytest.approx(ref[tok].item(), abs=1e-4), f"{name}: token {i}"
        if not sampling.do_sample:
            assert tok == int(scores.argmax())
        best_kept = [t for t in ref.argsort(descending=True).tolist() if kept[t]][:TOP_N]
        assert [t for t, _ in tops[i]] == best_kept, f"{name}: token {i}'s alternatives"
        assert [lp for _, lp in tops[i]] == pytest.approx(ref[best_kept].tolist(), abs=1e-4)
    if name == "top_k_fewer_than_top_n":
        assert all(len(top) == 2 for top in tops)


def test_prompt_logprobs_match_transformers(setup: tuple[LLMEngine, Any]) -> None:
    engine, hf = setup
    outs = generate(engine, "prompt-lp", SamplingParams(prompt_logprobs=True), new=1)
    got = outs[0].prompt_logprobs
    assert got is not None and got[0] is None and len(got) == len(PROMPT)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float().log_softmax(-1)
    for i in range(1, len(PROMPT)):
        assert got[i] == pytest.approx(ref[i - 1, PROMPT[i]].item(), abs=1e-4)


def test_top_n_tokens_are_the_best_alternatives(setup: tuple[LLMEngine, Any]) -> None:
    engine, hf = setup
    outs = generate(engine, "top-n", SamplingParams(top_n_tokens=3), new=1)
    assert outs[0].top_tokens is not None
    top = outs[0].top_tokens[0]
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0, -1].float().log_softmax(-1)
    values, ids = ref.topk(3)
    assert [t for t, _ in top] == ids.tolist()
    assert [lp for _, lp in top] == pytest.approx(values.tolist(), abs=1e-4)
    assert top[0][0] == outs[0].token_ids[0]
