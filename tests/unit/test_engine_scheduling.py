"""Prefix caching, chunked prefill and priorities through the real engine (tiny Llama, CPU)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from loom.engine.llm_engine import LLMEngine
from loom.engine.types import EngineOutput, EngineRequest, FinishReason, SamplingParams, StoppingParams
from loom.worker.fault_injection import FaultInjectingRunner
from loom.worker.model_runner import ModelRunner


def req(rid: str, prompt: list[int], new: int, **kw: object) -> EngineRequest:
    sampling = kw.pop("sampling", SamplingParams())
    return EngineRequest(rid, tuple(prompt), sampling,  # type: ignore[arg-type]
                         StoppingParams(max_new_tokens=new, ignore_eos=True), **kw)  # type: ignore[arg-type]


def drive(engine: LLMEngine, reqs: list[EngineRequest], arrivals: dict[str, int] | None = None
          ) -> tuple[dict[str, list[int]], dict[str, list[EngineOutput]]]:
    arrivals = arrivals or {}
    pending = sorted(reqs, key=lambda r: arrivals.get(r.request_id, 0))
    tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    outs: dict[str, list[EngineOutput]] = {r.request_id: [] for r in reqs}
    step = 0
    while pending or engine.has_unfinished():
        while pending and arrivals.get(pending[0].request_id, 0) <= step:
            engine.add_request(pending.pop(0))
        for o in engine.step():
            tokens[o.request_id].extend(o.token_ids)
            outs[o.request_id].append(o)
        step += 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return tokens, outs


def shared_prefix_workload(seed: int, n: int = 24) -> tuple[list[EngineRequest], dict[str, int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 320) for _ in range(rng.randint(9, 30))] for _ in range(3)]
    reqs, arrivals = [], {}
    for i in range(n):
        prompt = rng.choice(systems) + [rng.randrange(3, 320) for _ in range(rng.randint(1, 12))]
        reqs.append(req(f"r{i}", prompt, rng.randint(1, 25)))
        arrivals[f"r{i}"] = rng.randint(0, 40)
    return reqs, arrivals


@pytest.mark.parametrize("pool_tokens", [4096, 160])  # roomy, and tight enough to evict and preempt
def test_prefix_cache_on_equals_off(make_engine: Callable[..., LLMEngine], pool_tokens: int) -> None:
    reqs, arrivals = shared_prefix_workload(seed=pool_tokens)
    off, _ = drive(make_engine(enable_prefix_caching=False, max_batch_total_tokens=4096), reqs, arrivals)
    engine = make_engine(enable_prefix_caching=True, max_batch_total_tokens=pool_tokens,
                         max_total_tokens=128, max_batch_prefill_tokens=48)
    on, outs = drive(engine, reqs, arrivals)
    assert on == off
    stats = engine.stats()
    assert stats.prefix_cache_hits > 0
    if pool_tokens == 160:
        assert engine.block_manager.stats.evictions > 0
        assert stats.num_preemptions > 0
    cached = [o[0].num_cached_tokens for o in outs.values()]
    assert max(cached) >= 8 and all(c % 4 == 0 for c in cached)


def test_cached_tokens_reported_and_prompt_logprobs_exact_on_a_hit(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine(max_batch_total_tokens=1024)
    prompt = list(range(20, 45))
    _, first = drive(engine, [req("a", prompt, 2, sampling=SamplingParams(prompt_logprobs=True))])
    _, second = drive(engine, [req("b", prompt, 2)])
    assert second["b"][0].num_cached_tokens == 24
    _, third = drive(engine, [req("c", prompt, 2, sampling=SamplingParams(prompt_logprobs=True))])
    a_lp, c_lp = first["a"][0].prompt_logprobs, third["c"][0].prompt_logprobs
    assert a_lp is not None and c_lp is not None and len(c_lp) == len(prompt)
    assert c_lp == pytest.approx(a_lp, abs=1e-5)


def test_long_prompt_does_not_stall_running_decodes(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine(max_batch_total_tokens=4096, max_batch_prefill_tokens=16, max_total_tokens=128)
    for i in range(4):
        engine.add_request(req(f"d{i}", [5 + i, 6, 7], 60))
    last_token_step = {f"d{i}": 0 for i in range(4)}
    max_gap, step, first_long = 0, 0, None
    while engine.has_unfinished():
        step += 1
        if step == 3:
            engine.add_request(req("long", list(range(3, 103)), 5))  # 100 tokens: 7 chunks of 16
        for o in engine.step():
            if o.request_id == "long":
                first_long = first_long or step
            elif o.token_ids:
                max_gap = max(max_gap, step - last_token_step[o.request_id])
                last_token_step[o.request_id] = step
    assert first_long is not None and first_long >= 3 + 6  # the prompt really was chunked
    assert max_gap == 1  # every decode got its token in every step meanwhile
    assert engine.stats().num_prefill_chunks >= 6


def test_priority_orders_admission_and_age_bound_prevents_starvation(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine(max_batch_total_tokens=1024, max_batch_size=1)
    now = [0.0]
    engine.scheduler.clock = lambda: now[0]
    low = EngineRequest("low", (5, 6, 7), stopping=StoppingParams(max_new_tokens=2, ignore_eos=True),
                        priority=5, arrival_time=0.0)
    high = EngineRequest("high", (5, 6, 8), stopping=StoppingParams(max_new_tokens=2, ignore_eos=True),
                         priority=-1, arrival_time=1.0)
    engine.add_request(low)
    engine.add_request(high)
    order = [o.request_id for o in _run(engine)]
    assert order.index("high") < order.index("low")
    # once a request is older than max_queue_age_s it is served first, whatever its priority
    engine.add_request(EngineRequest("old-low", (5, 6, 7), stopping=StoppingParams(max_new_tokens=2, ignore_eos=True),
                                     priority=9, arrival_time=0.0))
    engine.add_request(EngineRequest("new-high", (5, 6, 8), stopping=StoppingParams(max_new_tokens=2, ignore_eos=True),
                                     priority=-9, arrival_time=100.0))
    now[0] = 120.0
    order = [o.request_id for o in _run(engine)]
    assert order.index("old-low") < order.index("new-high")


def _run(engine: LLMEngine) -> list[EngineOutput]:
    outs: list[EngineOutput] = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def test_preemption_victim_is_the_lowest_priority(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine(max_batch_total_tokens=48, max_total_tokens=48)  # 12 blocks of 4
    engine.scheduler.clock = lambda: 10.0  # both requests are young: priorities decide
    vip = EngineRequest("vip", tuple(range(3, 20)), stopping=StoppingParams(max_new_tokens=20, ignore_eos=True),
                        priority=-5, arrival_time=5.0)
    bulk = EngineRequest("bulk", tuple(range(30, 47)), stopping=StoppingParams(max_new_tokens=20, ignore_eos=True),
                         priority=5, arrival_time=1.0)
    engine.add_request(bulk)
    engine.add_request(vip)
    preempted: list[str] = []
    while engine.has_unfinished():
        before = engine.scheduler.num_preemptions
        engine.step()
        if engine.scheduler.num_preemptions > before:
            preempted += [s.request_id for s in engine.scheduler.waiting]
    assert preempted and set(preempted) == {"bulk"}


def test_a_failing_request_fails_alone(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine(max_batch_total_tokens=1024, fault_injection=True)
    good = [req(f"ok{i}", [5 + i, 6, 7, 8], 12) for i in range(4)]
    alone, _ = drive(make_engine(max_batch_total_tokens=1024), good)
    bad = [req("inject-fault-1", [9, 9, 9], 12), req("inject-nan-1", [8, 8, 8], 12)]
    tokens, outs = drive(engine, good + bad, arrivals={"inject-fault-1": 3, "inject-nan-1": 5})
    for r in good:
        assert tokens[r.request_id] == alone[r.request_id]
    assert outs["inject-fault-1"][-1].error and "injected failure" in outs["inject-fault-1"][-1].error
    assert outs["inject-nan-1"][-1].error and "non-finite" in outs["inject-nan-1"][-1].error
    assert not engine.requests


def test_fault_injection_is_a_runner_installed_only_with_the_flag(make_engine: Callable[..., LLMEngine]) -> None:
    """Without --fault-injection the engine runs the plain runner, and requests named like the
    injected faults run as any other."""
    engine = make_engine(max_batch_total_tokens=1024)
    assert type(engine.runner) is ModelRunner
    assert isinstance(make_engine(max_batch_total_tokens=1024, fault_injection=True).runner, FaultInjectingRunner)
    tokens, outs = drive(engine, [req("inject-fault-2", [9, 9, 9], 4), req("inject-nan-2", [8, 8, 8], 4)])
    for rid in ("inject-fault-2", "inject-nan-2"):
        assert not any(o.error for o in outs[rid]) and outs[rid][-1].finish_reason is not None and tokens[rid]


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_a_request_whose_penalty_or_temperature_overflows_fails_alone(make_engine: Callable[..., LLMEngine],
                                                                       async_scheduling: str) -> None:
    """Validation keeps such values out; the engine still fails the row, not the batch, should a
    logit overflow (1e-45, float32's smallest, turns any positive logit into inf)."""
    good = [req(f"ok{i}", [5 + i, 6, 7, 8], 12) for i in range(3)]
    good.append(req("ok-sampled", [11, 12, 13], 12, sampling=SamplingParams(do_sample=True, top_p=0.9, seed=3)))
    alone, _ = drive(make_engine(max_batch_total_tokens=1024), good)
    bad = [req("penalty", list(range(3, 40)), 12, sampling=SamplingParams(repetition_penalty=1e-45)),
           req("temperature", [9, 9, 9], 12, sampling=SamplingParams(do_sample=True, temperature=1e-45, seed=1))]
    engine = make_engine(max_batch_total_tokens=1024, async_scheduling=async_scheduling)
    tokens, outs = drive(engine, good + bad, arrivals={"penalty": 2, "temperature": 4})
    for r in good:
        assert tokens[r.request_id] == alone[r.request_id]
    for name in ("penalty", "temperature"):
        assert tokens[name] == []
        last = outs[name][-1]
        assert last.finish_reason is FinishReason.ERROR and last.error and "non-finite" in last.error, last
    assert not engine.requests
    assert (engine.num_async_steps > 0) == (async_scheduling == "on")


def test_prompts_admitted_together_share_their_prefix(make_engine: Callable[..., LLMEngine]) -> None:
    """W4's pattern: requests with one long common prefix arriving at once. The first step fills
    the prefix blocks once; the other prompts of that same step already start on them."""
    prefix = list(range(40, 80))  # 10 blocks of 4
    reqs = [req(f"r{i}", [*prefix, 100 + i, 200 + i, 7], 5) for i in range(6)]
    off, _ = drive(make_engine(enable_prefix_caching=False, max_batch_total_tokens=1024), reqs)
    engine = make_engine(enable_prefix_caching=True, max_batch_total_tokens=1024)
    on, outs = drive(engine, reqs)
    assert on == off
    assert [outs[f"r{i}"][0].num_cached_tokens for i in range(6)] == [0] + [40] * 5
    assert engine.num_steps == 5  # all six prefilled in the first step


def test_a_long_prompt_alone_is_chunked_and_exact(make_engine: Callable[..., LLMEngine]) -> None:
    """Steps that only carry prefill chunks sample nothing (no row completes a prompt)."""
    prompt = [(7 * i) % 300 + 3 for i in range(90)]
    whole, _ = drive(make_engine(max_batch_total_tokens=1024), [req("a", prompt, 6)])
    engine = make_engine(max_batch_total_tokens=1024, max_batch_prefill_tokens=16)
    chunked, _ = drive(engine, [req("a", prompt, 6)])
    assert chunked == whole
    assert engine.stats().num_prefill_chunks == 5  # 90 tokens: 5 chunks of 16, then the last 10
