"""--max-step-latency-ms (engine/step_latency.py): the step-time model, the scheduler's prefill
budget in steps that carry decodes, and the engine's tokens unchanged by it."""

from __future__ import annotations

from pathlib import Path

import pytest

from loom.config import ConfigError, EngineConfig
from loom.engine.block_manager import BlockManager
from loom.engine.scheduler import Scheduler, SchedulerConfig
from loom.engine.sequence import Sequence
from loom.engine.step_latency import StepLatencyModel
from loom.engine.types import EngineRequest


def seq(rid: str, n: int) -> Sequence:
    return Sequence(EngineRequest(rid, tuple(range(1, n + 1))), 0, None)


def run_step(s: Scheduler) -> list[tuple[str, int]]:
    """Schedule, then pretend the forward ran and every row sampled a token."""
    out = s.schedule()
    for q, n in zip(out.seqs, out.num_new_tokens, strict=True):
        q.num_computed_tokens += n
        if q.num_computed_tokens >= q.num_prompt_tokens:
            q.token_ids.append(7)
    return [(q.request_id, n) for q, n in zip(out.seqs, out.num_new_tokens, strict=True)]


def test_model_fits_step_time_and_budgets_the_prefill() -> None:
    model = StepLatencyModel(target_s=0.050, max_tokens=4096, min_tokens=16)
    assert model.prefill_budget(10) == 256  # no fit yet: a short first guess
    for i in range(40):  # step_s = 10 ms + 1 ms a decode row + 0.1 ms a prompt token
        decodes, prefill = i % 7, (i * 37) % 500
        model.observe(decodes, prefill, 0.010 + 0.001 * decodes + 0.0001 * prefill)
    a, m, b, c = model.coefficients or (0, 0, 0, 0)
    assert (a + m, b, c) == pytest.approx((0.010, 0.001, 0.0001), rel=1e-6)
    assert model.prefill_budget(10) == pytest.approx(300, abs=1)  # (50 - 10 - 10) ms / 0.1 ms, rounded down
    assert model.prefill_budget(45) == 16  # the decodes alone miss the target: prompts still advance
    assert StepLatencyModel(10.0, max_tokens=512).prefill_budget(1) == 256
    with pytest.raises(ConfigError, match="--max-step-latency-ms must be a positive number"):
        EngineConfig(max_step_latency_ms=0)


def test_steps_with_prompt_tokens_pay_their_own_intercept() -> None:
    """A GPU replays a graph for decode-only steps and launches mixed ones eagerly: 8 ms more for
    any prompt tokens. One intercept for both would budget mixed steps past the target."""
    model = StepLatencyModel(target_s=0.050, max_tokens=4096, min_tokens=16)
    for i in range(60):
        decodes, prefill = 20 + i % 9, 0 if i % 3 == 0 else 50 + (i * 37) % 400
        model.observe(decodes, prefill, 0.004 + 0.008 * (prefill > 0) + 0.0002 * decodes + 0.00005 * prefill)
    a, m, b, c = model.coefficients or (0, 0, 0, 0)
    assert (a, m, b, c) == pytest.approx((0.004, 0.008, 0.0002, 0.00005), rel=1e-6)
    assert model.prefill_budget(30) == 640  # (50 - 4 - 8 - 6) ms / 0.05 ms
    assert 0.004 + 0.008 + 0.0002 * 30 + 0.00005 * model.prefill_budget(30) == pytest.approx(0.050)


def test_noise_without_prefill_keeps_the_cold_budget() -> None:
    model = StepLatencyModel(target_s=0.05, max_tokens=4096)
    for i in range(20):
        model.observe(i, 0, 0.01)  # decode-only steps say nothing about prompt tokens
    assert model.coefficients is None and model.prefill_budget(3) == 256


def test_scheduler_caps_prefill_only_in_steps_with_decodes() -> None:
    s = Scheduler(SchedulerConfig(max_batch_prefill_tokens=100, enable_chunked_prefill=True), BlockManager(64, 4))
    asked: list[int] = []

    def budget(decodes: int) -> int:
        asked.append(decodes)
        return 12

    s.prefill_budget_with_decodes = budget
    s.add(seq("a", 40))
    assert run_step(s) == [("a", 40)]  # nothing decodes yet: the whole budget of 100
    s.add(seq("b", 50))
    assert run_step(s) == [("a", 1), ("b", 12)]  # a decodes: b's prompt in chunks of 12
    assert run_step(s) == [("a", 1), ("b", 12)]
    assert asked == [1, 1]


def test_engine_tokens_are_the_same_with_a_latency_target(tiny_llama_dir: Path) -> None:
    from loom.engine.llm_engine import LLMEngine
    from loom.engine.types import EngineRequest, SamplingParams, StoppingParams

    def run(**extra: float) -> tuple[dict[str, list[int]], LLMEngine]:
        engine = LLMEngine(EngineConfig(model_id=str(tiny_llama_dir), warmup=False, max_batch_total_tokens=2048,
                                        **extra))  # type: ignore[arg-type]
        engine.add_request(EngineRequest("early", tuple(range(5, 25)), SamplingParams(),
                                         StoppingParams(max_new_tokens=40, ignore_eos=True)))
        out: dict[str, list[int]] = {}
        for i in range(60):
            if i == 3:  # long prompts arrive while "early" decodes
                for j in range(3):
                    engine.add_request(EngineRequest(f"long{j}", tuple(range(100 + j, 500 + j)), SamplingParams(),
                                                     StoppingParams(max_new_tokens=8, ignore_eos=True)))
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.token_ids)
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.token_ids)
        return out, engine

    plain, unbounded = run()
    bounded, engine = run(max_step_latency_ms=1.0)  # below any step: the smallest chunks once fitted
    assert bounded == plain
    # without a target the three prompts (1,200 tokens) fit one step's 4,096; with it, steps that
    # carry decodes cut them into chunks
    assert unbounded.scheduler.counters.prefill_chunks == 0
    assert engine.scheduler.counters.prefill_chunks >= 3
