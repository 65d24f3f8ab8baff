"""Asynchronous scheduling gives exactly the outputs of synchronous scheduling.

With ``async_scheduling="on"`` the engine launches step N+1 before it reads step N's tokens back
(on CPU the forward still runs on the host, but every code path of the overlap runs: placeholder
tokens, inputs taken from the previous step's sampled ids, finishes detected one step late,
aborts and preemptions while a step is in flight). Every test runs one workload both ways.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from loom.engine.llm_engine import LLMEngine
from loom.engine.types import EngineOutput, EngineRequest, FinishReason, SamplingParams, StoppingParams

Outputs = dict[str, list[tuple[int, list[int], FinishReason | None, str | None]]]


def drive(engine: LLMEngine, reqs: list[EngineRequest], arrivals: dict[str, int] | None = None,
          aborts: dict[str, int] | None = None) -> Outputs:
    """Run to completion: ``arrivals[rid]`` / ``aborts[rid]`` are the steps of submit / abort."""
    arrivals, aborts = arrivals or {}, aborts or {}
    pending = sorted(reqs, key=lambda r: arrivals.get(r.request_id, 0))
    outs: Outputs = {r.request_id: [] for r in reqs}
    step = 0
    while pending or engine.has_unfinished():
        while pending and arrivals.get(pending[0].request_id, 0) <= step:
            engine.add_request(pending.pop(0))
        for rid, at in aborts.items():
            if at == step:
                engine.abort(rid)
        o: EngineOutput
        for o in engine.step():
            outs[o.request_id].append((o.index, list(o.token_ids), o.finish_reason, o.error))
        step += 1
        assert step < 10_000
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "KV blocks leaked"
    engine.block_manager.check_invariants([])
    return outs


def per_completion(outs: Outputs) -> dict[tuple[str, int], tuple[list[int], FinishReason | None]]:
    """Tokens and finish reason of each completion (message boundaries may differ)."""
    done: dict[tuple[str, int], tuple[list[int], FinishReason | None]] = {}
    for rid, msgs in outs.items():
        for index, tokens, reason, _ in msgs:
            prev, _r = done.get((rid, index), ([], None))
            done[(rid, index)] = (prev + tokens, reason)
    return done


def both_ways(make_engine: Callable[..., LLMEngine], reqs: list[EngineRequest],
              arrivals: dict[str, int] | None = None, **kw: object) -> tuple[Outputs, Outputs, LLMEngine]:
    sync = drive(make_engine(async_scheduling="off", **kw), reqs, arrivals)
    engine = make_engine(async_scheduling="on", **kw)
    asyn = drive(engine, reqs, arrivals)
    assert engine.num_async_steps > 0
    return sync, asyn, engine


def mixed_requests(seed: int, n: int) -> tuple[list[EngineRequest], dict[str, int]]:
    rng = random.Random(seed)
    reqs, arrivals = [], {}
    for i in range(n):
        prompt = tuple(rng.randrange(3, 320) for _ in range(rng.randint(2, 50)))
        kind = i % 4
        if kind == 0:
            sampling = SamplingParams()
        elif kind == 1:
            sampling = SamplingParams(do_sample=True, seed=1000 + i, temperature=1.3, top_k=40, top_p=0.9)
        elif kind == 2:
            sampling = SamplingParams(do_sample=True, seed=2000 + i, min_p=0.05)
        else:
            sampling = SamplingParams(top_n_tokens=3)
        # Half may stop early on EOS (id 2 of the tiny model) or a stop token.
        stopping = StoppingParams(max_new_tokens=rng.randint(1, 30), ignore_eos=i % 2 == 0,
                                  stop_token_ids=(rng.randrange(3, 320),), min_new_tokens=rng.randint(0, 3))
        reqs.append(EngineRequest(f"r{i}", prompt, sampling, stopping))
        arrivals[f"r{i}"] = rng.randint(0, 25)
    return reqs, arrivals


def test_mixed_batch_joining_and_leaving(make_engine: Callable[..., LLMEngine]) -> None:
    reqs, arrivals = mixed_requests(seed=1, n=32)
    sync, asyn, engine = both_ways(make_engine, reqs, arrivals, max_batch_total_tokens=4096,
                                   max_batch_prefill_tokens=96)
    assert per_completion(asyn) == per_completion(sync)
    assert engine.num_steps > 0


def test_preemption_while_a_step_is_in_flight(make_engine: Callable[..., LLMEngine]) -> None:
    reqs, arrivals = mixed_requests(seed=2, n=16)
    sync, asyn, engine = both_ways(make_engine, reqs, arrivals, max_batch_total_tokens=128,
                                   max_total_tokens=128, max_batch_prefill_tokens=48)
    assert engine.scheduler.num_preemptions > 0
    assert per_completion(asyn) == per_completion(sync)


def test_length_limits_are_exact(make_engine: Callable[..., LLMEngine]) -> None:
    # max_total_tokens 64 cuts long generations at the model's length, not one token later.
    reqs = [EngineRequest(f"r{i}", tuple(range(5, 5 + 20 + i)), SamplingParams(),
                          StoppingParams(max_new_tokens=100, ignore_eos=True)) for i in range(6)]
    sync, asyn, _ = both_ways(make_engine, reqs, None, max_batch_total_tokens=1024, max_total_tokens=64)
    done = per_completion(asyn)
    assert done == per_completion(sync)
    for i in range(6):
        tokens, reason = done[(f"r{i}", 0)]
        assert reason is FinishReason.LENGTH and len(tokens) == 64 - (20 + i)


def test_n_completions_penalties_and_prefix_hits(make_engine: Callable[..., LLMEngine]) -> None:
    rng = random.Random(3)
    system = tuple(rng.randrange(3, 320) for _ in range(17))
    reqs = []
    for i in range(12):
        prompt = system + tuple(rng.randrange(3, 320) for _ in range(rng.randint(1, 9)))
        if i % 3 == 0:
            sampling = SamplingParams(do_sample=True, seed=i, temperature=0.8)
        elif i % 3 == 1:
            sampling = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.2)  # forces sync steps
        else:
            sampling = SamplingParams()
        new = 3 if i % 3 == 1 else 16  # the penalised ones end early: later steps overlap again
        reqs.append(EngineRequest(f"r{i}", prompt, sampling, StoppingParams(max_new_tokens=new, ignore_eos=True),
                                  n=2 if i % 3 == 0 else 1))
    arrivals = {f"r{i}": i // 3 for i in range(12)}
    sync, asyn, engine = both_ways(make_engine, reqs, arrivals, max_batch_total_tokens=1024)
    assert per_completion(asyn) == per_completion(sync)
    assert engine.stats().prefix_cache_hits > 0


def test_abort_while_a_step_is_in_flight(make_engine: Callable[..., LLMEngine]) -> None:
    reqs = [EngineRequest(f"r{i}", tuple(range(10 + i, 30 + i)), SamplingParams(),
                          StoppingParams(max_new_tokens=20, ignore_eos=True)) for i in range(4)]
    engine = make_engine(async_scheduling="on", max_batch_total_tokens=1024)
    outs = drive(engine, reqs, aborts={"r1": 4, "r2": 7})
    alone = drive(make_engine(async_scheduling="off", max_batch_total_tokens=1024), [reqs[0], reqs[3]])
    done = per_completion(outs)
    assert done[("r0", 0)] == per_completion(alone)[("r0", 0)]
    assert done[("r3", 0)] == per_completion(alone)[("r3", 0)]
    assert len(done[("r1", 0)][0]) < 20 and done[("r1", 0)][1] is None


def test_a_failing_request_fails_alone(make_engine: Callable[..., LLMEngine]) -> None:
    good = [EngineRequest(f"ok{i}", (5 + i, 6, 7, 8), SamplingParams(),
                          StoppingParams(max_new_tokens=12, ignore_eos=True)) for i in range(4)]
    bad = [EngineRequest(name, (9, 9, 9), SamplingParams(), StoppingParams(max_new_tokens=12, ignore_eos=True))
           for name in ("inject-fault-1", "inject-nan-1")]
    alone = per_completion(drive(make_engine(async_scheduling="off", max_batch_total_tokens=1024), good))
    engine = make_engine(async_scheduling="on", max_batch_total_tokens=1024, fault_injection=True)
    outs = drive(engine, good + bad, arrivals={"inject-fault-1": 3, "inject-nan-1": 5})
    done = per_completion(outs)
    for r in good:
        assert done[(r.request_id, 0)] == alone[(r.request_id, 0)]
    assert outs["inject-fault-1"][-1][3] and "injected failure" in str(outs["inject-fault-1"][-1][3])
    assert outs["inject-nan-1"][-1][3] and "non-finite" in str(outs["inject-nan-1"][-1][3])
    assert not engine.requests
