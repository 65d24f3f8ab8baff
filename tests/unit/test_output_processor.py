"""The output processor over a list of accepted tokens per sequence (what verified drafts give):
stop checks run token by token, the tokens after a stop are dropped, and the tokens that are kept
become the sequence's context for the next step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from loom.engine.llm_engine import LLMEngine
from loom.engine.types import EngineOutput, EngineRequest, FinishReason, SamplingParams, StoppingParams
from loom.worker.step_plan import StepOutput


def _with_extra_tokens(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, extra: list[int]) -> None:
    """Every sampled sequence accepts ``extra`` after the token the model chose, as if they were
    drafts the model agreed with."""
    finish = engine.worker.finish

    def finish_with_drafts(step: Any) -> StepOutput:
        out = finish(step)
        out.token_ids = [[*t, *extra] for t in out.token_ids]
        out.logprobs = [[*lp, *(-0.5 for _ in extra)] for lp in out.logprobs]
        return out

    monkeypatch.setattr(engine.worker, "finish", finish_with_drafts)


def _run(engine: LLMEngine, request: EngineRequest) -> list[EngineOutput]:
    engine.add_request(request)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def test_several_tokens_per_step_up_to_max_new_tokens(make_engine: Callable[..., LLMEngine],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine()
    _with_extra_tokens(engine, monkeypatch, [11, 12])
    outs = _run(engine, EngineRequest("r", (5, 6, 7), SamplingParams(),
                                      StoppingParams(max_new_tokens=7, ignore_eos=True)))
    assert [len(o.token_ids) for o in outs] == [3, 3, 1]  # the last list is cut at max_new_tokens
    assert [o.token_ids[1:] for o in outs[:2]] == [[11, 12], [11, 12]]
    assert outs[-1].finish_reason is FinishReason.LENGTH
    assert all(len(o.logprobs) == len(o.token_ids) for o in outs)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_stop_inside_the_list_drops_the_tokens_after_it(make_engine: Callable[..., LLMEngine],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine()
    eos = engine.eos_token_ids[0]
    _with_extra_tokens(engine, monkeypatch, [eos, 12])
    outs = _run(engine, EngineRequest("r", (5, 6, 7), SamplingParams(), StoppingParams(max_new_tokens=20)))
    assert len(outs) == 1 and outs[0].token_ids[1:] == [eos]
    assert outs[0].finish_reason is FinishReason.EOS_TOKEN


def test_min_new_tokens_holds_over_the_list(make_engine: Callable[..., LLMEngine],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """An accepted EOS before min_new_tokens does not stop the sequence (the sampler never
    chooses one there; a draft may still carry one)."""
    engine = make_engine()
    eos = engine.eos_token_ids[0]
    _with_extra_tokens(engine, monkeypatch, [eos])
    outs = _run(engine, EngineRequest("r", (5, 6, 7), SamplingParams(),
                                      StoppingParams(max_new_tokens=20, min_new_tokens=3)))
    tokens = [t for o in outs for t in o.token_ids]
    assert outs[-1].finish_reason is FinishReason.EOS_TOKEN
    assert len(tokens) == 4 and tokens[1] == eos and tokens[3] == eos  # the first EOS came before the minimum


def test_kept_tokens_are_the_next_steps_context(make_engine: Callable[..., LLMEngine],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Accepted tokens join the sequence: the step after reads them as its input (the scheduler
    computes what is not in the KV pool yet), so the run equals one where they were prompt."""
    engine = make_engine()
    _with_extra_tokens(engine, monkeypatch, [11, 12])
    first = _run(engine, EngineRequest("a", (5, 6, 7), SamplingParams(), StoppingParams(max_new_tokens=4,
                                                                                         ignore_eos=True)))
    chosen = first[0].token_ids[0]
    second_step_model_token = first[1].token_ids[0]
    plain = make_engine()
    outs = _run(plain, EngineRequest("b", (5, 6, 7, chosen, 11, 12), SamplingParams(),
                                     StoppingParams(max_new_tokens=1, ignore_eos=True)))
    assert outs[0].token_ids == [second_step_model_token]
