"""Logprobs through the engine equal transformers' processed scores (CPU fp32, within 1e-4).

transformers has no frequency/presence penalty processor: those are checked against their
formula in test_sampler.py."""

from __future__ import annotations

from collections.abc import Callable
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


CASES: list[tuple[str, SamplingParams, Callable[[], list[Any]]]] = [
    ("greedy", SamplingParams(), lambda: []),
    ("repetition", SamplingParams(repetition_penalty=1.4), lambda: [RepetitionPenaltyLogitsProcessor(1.4)]),
    ("temperature", SamplingParams(do_sample=True, temperature=0.6, seed=1), lambda: [TemperatureLogitsWarper(0.6)]),
    ("top_k", SamplingParams(do_sample=True, top_k=7, seed=2), lambda: [TopKLogitsWarper(7)]),
    ("top_p", SamplingParams(do_sample=True, top_p=0.7, seed=3), lambda: [TopPLogitsWarper(0.7)]),
    ("typical_p", SamplingParams(do_sample=True, typical_p=0.5, seed=4), lambda: [TypicalLogitsWarper(0.5)]),
    ("min_p", SamplingParams(do_sample=True, min_p=0.05, seed=5), lambda: [MinPLogitsWarper(0.05)]),
    ("combined", SamplingParams(do_sample=True, temperature=1.3, top_k=40, top_p=0.9, repetition_penalty=1.2, seed=6),
     lambda: [RepetitionPenaltyLogitsProcessor(1.2), TemperatureLogitsWarper(1.3), TopKLogitsWarper(40),
              TopPLogitsWarper(0.9)]),
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
    _, sampling, procs = next(c for c in CASES if c[0] == name)
    outs = generate(engine, name, sampling)
    tokens = [t for o in outs for t in o.token_ids]
    ours = [lp for o in outs for lp in o.logprobs]
    processors = LogitsProcessorList(procs())
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + tokens])).logits[0].float()  # [P+N, V]
    for i, tok in enumerate(tokens):
        ids = torch.tensor([PROMPT + tokens[:i]])
        scores = processors(ids, logits[len(PROMPT) - 1 + i][None].clone())
        ref = scores.log_softmax(-1)[0, tok].item()
        assert ours[i] == pytest.approx(ref, abs=1e-4), f"{name}: token {i}"
        if not sampling.do_sample:
            assert tok == int(scores.argmax())


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
