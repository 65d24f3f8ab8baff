"""W5 b and c: speculation with a draft model at batch 1, and what verification costs.

One engine holds the target and its draft model (``--speculator draft``), with CUDA graphs for
every verification width the runs use. On it, in one process and alternating:

- **W5 c, the cost curve.** The target's step time for ``B`` sequences of ``q = 1 + k`` query
  rows each (k drafts, all rows sampled, as a verification samples them), at a context of
  ``context`` tokens, for ``B`` in 1, 16, 64 and ``k`` in 0..8; the draft model's decode step at
  batch 1 the same way. Each timing is the median of ``iters`` synchronous steps through the
  worker (stage the plan, replay the graph, sample, read back), after warm-up.
- **W5 b.** W1's request (512 prompt tokens, 256 new, ``ignore_eos``) without speculation (the
  speculator steps aside: its batch limit is set to 0 for that run, so the same engine and graphs
  decode plainly) and with ``k`` drafts for each ``k``: output tok/s, acceptance per draft
  position, tokens per verification.

**The cost model** predicts each run's speedup from what was measured apart from it: a
speculating step verifies k drafts in one target step of width 1 + k (W5 c, batch 1) after the
draft has made them in k draft steps (the first one also catches the draft up on the tokens the
target accepted: one or two rows, so it costs about a decode step) and gains ``E`` tokens,
``E = 1 + sum over i of prod_{j <= i} a_j`` with ``a_j`` the measured acceptance at position j
given that the drafts before it were accepted; a step that does not verify (the speculator
steps aside for a sequence whose drafts keep being rejected) is a decode step. With ``V``
verifying and ``D`` plain decode steps in the run:

    predicted speedup = (D + V * E) * t_target(1) / (D * t_target(1) + V * (t_target(1 + k) + k * t_draft(1)))

(at full acceptance of every step: ``E * t_target(1) / (t_target(1 + k) + k * t_draft(1))``).
The engine's efficiency is the measured speedup, against the plain engine with its
asynchronous scheduling, over that: what the step loop, the scheduler and the host add or lose
beyond the model steps themselves (speculating steps run synchronously: drafts are proposed
from tokens on the host).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import replace
from typing import Any

from loom.config import EngineConfig
from loom.engine.types import EngineRequest, SamplingParams, StoppingParams
from loom.process_tuning import startup_objects_frozen


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_time(worker: Any, batch: int, q: int, context: int, iters: int, seed: int = 0) -> float:
    """Median seconds of one synchronous step of ``batch`` sequences with ``q`` rows each at
    ``context`` tokens of context (random tokens; the KV read is whatever the pool holds)."""
    from loom.sample.batch import SamplingPlan
    from loom.worker.step_plan import StepPlan

    bs = worker.config.block_size
    per_seq = -(-(context + q) // bs)
    vocab = worker.info.vocab_size
    rng = random.Random(seed)
    tables = [[b * per_seq + j for j in range(per_seq)] for b in range(batch)]
    ids, positions, slots = [], [], []
    for b in range(batch):
        for j in range(q):
            p = context + j
            ids.append(rng.randrange(vocab))
            positions.append(p)
            slots.append(tables[b][p // bs] * bs + p % bs)
    rows = batch * q
    greedy = SamplingPlan.greedy(rows, vocab)
    plan = StepPlan(input_ids=ids, positions=positions, slot_mapping=slots, query_lens=[q] * batch,
                    seq_lens=[context + q] * batch, block_tables=tables, pending_rows=[], pending_src=[],
                    sample_rows=list(range(rows)), sample_seq_ids=list(range(batch)),
                    sample_request_ids=[""] * batch, sampling=greedy,
                    num_drafts=[q - 1] * batch if q > 1 else None,
                    draft_token_ids=[ids[b * q + j] for b in range(batch) for j in range(1, q)] if q > 1 else [])
    times = []
    for i in range(iters + 3):
        _sync(worker.device)
        started = time.perf_counter()
        worker.finish(worker.execute(plan))
        if i >= 3:  # warm-up first
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def _w1_request(vocab: int, prompt: int, new: int, tag: str, speculate: bool) -> EngineRequest:
    rng = random.Random(1)
    ids = tuple(rng.randint(10, min(1000, vocab - 1)) for _ in range(prompt))
    return EngineRequest(f"w5b-{tag}", ids, SamplingParams(speculate=speculate),
                         StoppingParams(max_new_tokens=new, ignore_eos=True))


def _decode(engine: Any, request: EngineRequest,
            trace: list[tuple[float, bool, bool]] | None = None) -> tuple[float, list[int], int]:
    """Seconds from the first decode step to the last token (the prompt's step apart), tokens,
    steps. ``trace`` gets each timed ``engine.step()`` call: (seconds, whether it verified
    drafts, whether the step it launched was left in flight)."""
    engine.add_request(request)
    tokens: list[int] = []
    started = None
    steps = 0
    spec = engine.speculator
    while engine.has_unfinished():
        t0 = time.perf_counter()
        verified = spec.counters.steps if spec is not None else 0
        overlapped = engine.num_async_steps
        for out in engine.step():
            tokens += out.token_ids
        if started is not None and trace is not None:
            trace.append((time.perf_counter() - t0, spec is not None and spec.counters.steps > verified,
                          engine.num_async_steps > overlapped))
        if started is None and tokens:
            _sync(engine.device)
            started, steps = time.perf_counter(), 0
        steps += 1
    assert started is not None
    return time.perf_counter() - started, tokens, steps


class _DraftStepLog:
    """The draft model's steps during a run: new tokens, whether a CUDA graph served it, seconds
    (each draft step is synchronous: its time is its device time plus its host time)."""

    def __init__(self, proposer: Any) -> None:
        self.steps: list[tuple[int, bool, float]] = []
        inner = getattr(proposer, "_step", None)
        worker = getattr(proposer, "worker", None)
        if inner is None or worker is None:
            return  # not the built-in draft model: nothing to time

        def timed(seqs: list[Any]) -> list[int]:
            graphs = worker.runner.cuda_graphs if worker.runner is not None else None
            replays = graphs.num_replays if graphs is not None else 0
            new_tokens = sum(len(st.tokens) - st.computed for st in seqs)
            t0 = time.perf_counter()
            out: list[int] = inner(seqs)
            self.steps.append((new_tokens, graphs is not None and graphs.num_replays > replays,
                               time.perf_counter() - t0))
            return out

        proposer._step = timed  # instance attribute: this engine's proposer only, for the bench


def _breakdown(trace: list[tuple[float, bool, bool]], draft: list[tuple[int, bool, float]]) -> dict[str, Any]:
    """Where a speculating run's time went, by kind of step: those that verified (with the draft
    steps inside them), the one right after each (launched once the verification was read back),
    the overlapped ones (launched while the previous step ran, as the plain engine runs all its
    steps), and any other synchronous one."""
    kinds: dict[str, list[float]] = {"verifying": [], "after_verifying": [], "overlapped": [], "other_sync": []}
    after = False
    for seconds, verified, overlapped in trace:
        kind = "verifying" if verified else "after_verifying" if after else "overlapped" if overlapped \
            else "other_sync"
        kinds[kind].append(seconds)
        after = verified
    out: dict[str, Any] = {f"{k}_steps": len(v) for k, v in kinds.items()}
    out.update({f"{k}_s": sum(v) for k, v in kinds.items()})
    graphed = [s for _, g, s in draft if g]
    out["draft_graph_steps"], out["draft_graph_s"] = len(graphed), sum(graphed)
    out["draft_eager_steps_tokens_ms"] = [[t, round(s * 1e3, 2)] for t, g, s in draft if not g]
    # graphed steps of more than 2 new tokens: catch-ups laid out at a catch-up width (batch 1)
    out["draft_graph_catch_ups_tokens_ms"] = [[t, round(s * 1e3, 2)] for t, g, s in draft if g and t > 2]
    out["draft_s"] = sum(s for _, _, s in draft)
    return out


def run_w5(base: EngineConfig, draft_options: tuple[tuple[str, str], ...], ks: tuple[int, ...] = (2, 3, 4, 5, 6),
           cost_ks: tuple[int, ...] = tuple(range(9)), cost_batches: tuple[int, ...] = (1, 16, 64),
           context: int = 512, new: int = 256, iters: int = 20, quick: bool = False) -> dict[str, Any]:
    from loom.engine.llm_engine import LLMEngine

    if quick:
        ks, cost_ks, cost_batches, new, iters = ks[:2], (0, 1, 2), (1, 2), 16, 2
    kmax = max(ks)
    cfg = replace(base, speculate=kmax, speculator="draft", speculator_options=draft_options,
                  speculate_max_batch_size=max(1, base.speculate_max_batch_size))
    engine = LLMEngine(cfg)
    assert engine.speculator is not None
    spec = engine.speculator
    widths = tuple(sorted({1, *(k + 1 for k in (*ks, *cost_ks))}))
    engine.worker.capture_cuda_graphs(engine.max_model_len, widths)
    # frozen, as in the server: a full collection of the start-up objects (0.2-0.3 s on the
    # H200's host) must not land in a timed run
    with startup_objects_frozen():
        draft_worker = getattr(spec.proposer, "worker", None)
        result: dict[str, Any] = {
            "description": (f"W5 b: W1's request ({context} prompt tokens, {new} new, batch 1) with a draft model "
                            f"({dict(draft_options)}), k in {list(ks)}, against none on the same engine; W5 c: "
                            f"target step time for query length 1 + k at batch {list(cost_batches)}, context {context}"),
            "draft_options": dict(draft_options),
        }
        # W5 c: the cost curve (and the draft's decode step)
        curve: dict[str, dict[str, float]] = {}
        for b in cost_batches:
            curve[f"batch_{b}"] = {f"k_{k}": step_time(engine.worker, b, k + 1, context, iters) for k in cost_ks}
        result["cost_curve_s"] = curve
        result["cost_curve_relative"] = {
            name: {key: t / row["k_0"] for key, t in row.items()} for name, row in curve.items()}
        t_draft = step_time(draft_worker, 1, 1, context, iters) if draft_worker is not None else 0.0
        result["draft_decode_step_s"] = t_draft
        # W5 b: plain and speculating runs, alternating on the one engine
        limit = spec.max_batch_size
        runs: dict[str, Any] = {}
        vocab = engine.worker.info.vocab_size
        draft_log = _DraftStepLog(spec.proposer)
        # untimed first, for every k: the draft's prefill of the prompt and every first-use shape
        # (the first timed run, k = 2, measured 0.54 of the cost model with one warm run at k = 6:
        # its catch-ups of 17, 33 and 65 tokens compiled W4A16 variants the 32-token warm runs never
        # reached; the draft now warms those up when it is built)
        for k in ks:
            spec.k = k
            spec.reset()
            _decode(engine, _w1_request(vocab, context, min(new, 32), f"warm-{k}", speculate=True))
        plain_s, plain_tokens, plain_steps = 0.0, None, 0
        t1 = curve[f"batch_{cost_batches[0]}"]["k_0"]
        for k in ks:
            spec.max_batch_size = 0  # steps aside: plain decoding on the same engine and graphs
            s, toks, steps = _decode(engine, _w1_request(vocab, context, new, f"plain-{k}", speculate=False))
            plain_s += s
            plain_steps += steps
            if plain_tokens is None:
                plain_tokens = toks
            spec.max_batch_size, spec.k = limit, k
            spec.reset()
            trace: list[tuple[float, bool, bool]] = []
            draft_log.steps.clear()
            s_spec, toks_spec, steps_spec = _decode(engine, _w1_request(vocab, context, new, f"k{k}", speculate=True),
                                                    trace)
            c = spec.counters
            cond = c.conditional_acceptance_at()[:k]
            expected, chain = 1.0, 1.0
            for a in cond:
                chain *= a
                expected += chain
            t_verify = curve[f"batch_{cost_batches[0]}"][f"k_{k}"] if f"k_{k}" in curve[f"batch_{cost_batches[0]}"] \
                else step_time(engine.worker, 1, k + 1, context, iters)
            verifying = c.verifications
            decoding = max(0, len(toks_spec) - 1 - (c.accepted_tokens + verifying))  # tokens made by plain steps
            predicted = ((decoding + verifying * expected) * t1
                         / (decoding * t1 + verifying * (t_verify + k * t_draft))) if verifying else 1.0
            plain_tok_s = len(toks) / s
            measured = (len(toks_spec) / s_spec) / plain_tok_s
            runs[f"k_{k}"] = {
                "plain_out_tok_s": plain_tok_s, "out_tok_s": len(toks_spec) / s_spec, "speedup": measured,
                "steps": steps_spec, "verifications": c.verifications, "draft_tokens": c.draft_tokens,
                "accepted_tokens": c.accepted_tokens,
                "acceptance": c.accepted_tokens / c.draft_tokens if c.draft_tokens else 0.0,
                "acceptance_at": c.acceptance_at()[:k], "conditional_acceptance_at": cond,
                "tokens_per_verification": (c.accepted_tokens + c.verifications) / c.verifications if c.verifications
                else 0.0,
                "expected_tokens_per_verification": expected,
                "plain_decode_steps": decoding,
                "predicted_speedup_if_every_step_verified": expected * t1 / (t_verify + k * t_draft),
                "predicted_speedup": predicted, "engine_efficiency": measured / predicted if predicted else 0.0,
                "same_tokens_as_plain": toks_spec == toks,
                "time": _breakdown(trace, draft_log.steps),
            }
        spec.max_batch_size, spec.k = limit, kmax
        result["plain_decode_step_s_in_runs"] = plain_s / plain_steps if plain_steps else 0.0
        result["runs"] = runs
        best = max(runs, key=lambda key: runs[key]["speedup"])
        result["best_k"] = int(best.removeprefix("k_"))
        result["best_speedup"] = runs[best]["speedup"]
    engine.close()
    return result
