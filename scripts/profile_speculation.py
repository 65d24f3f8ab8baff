"""Host time of a speculating step: an in-process engine decoding C3's copy requests at batch 1.

On the H200 a speculating step runs synchronously (the n-gram proposer needs the tokens on the
host), so its host path adds to the device time one for one: W5 a's speculating steps took about
1.75 ms against 1.2 ms for a plain (overlapped) one. This measures that path on any machine:

1. **record**: the real model decodes the requests (greedy, ``--speculate K`` n-gram), one at a
   time, and the tokens the sampler chose at every step are kept;
2. **replay** (``--repeat`` times): a fresh engine runs the same requests with the model's forward,
   its logits and the sampler replaced by stubs that cost microseconds and give back the recorded
   tokens. Everything else runs as it does: the scheduler, the proposer, the speculator's
   bookkeeping, the plan, staging, the sampling batch, reading the tokens back and verifying
   them, the output processor. The steps are those of the recorded run, token for token.

It prints the host time per speculating step and per plain step (median over the replays) and,
with ``--profile``, a cProfile of one replay restricted to the host path's own functions.

Usage: python scripts/profile_speculation.py [--requests N] [--new N] [--speculate K] [--repeat R]
       [--device cpu|cuda] [--dtype D] [--model-id M] [--profile] [--out FILE.json]
(the default model is the bundled SmolLM2). On a shared machine note the load average it prints:
compare runs made back to back.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import statistics
import time
from dataclasses import replace
from typing import Any

import torch

from loom.bench.speculation import c3_prompts
from loom.config import EngineConfig
from loom.engine.llm_engine import LLMEngine
from loom.engine.types import EngineRequest, SamplingParams, StoppingParams
from loom.model_loader import resolve_model_dir
from loom.process_tuning import startup_objects_frozen
from loom.sample.sampler import SamplerOutput

_HOST = r"(service/loom/(engine|spec|worker/(model_runner|staging|step_plan)|sample/(batch|verify))|plugins/speculative)"


def _requests(prompts: list[list[int]], new: int) -> list[EngineRequest]:
    return [EngineRequest(f"c3-{i}", tuple(p), SamplingParams(), StoppingParams(max_new_tokens=new))
            for i, p in enumerate(prompts)]


def _decode(engine: LLMEngine, requests: list[EngineRequest], profile: cProfile.Profile | None = None
            ) -> tuple[dict[str, list[float]], list[list[int]]]:
    """Each request alone; seconds of every step after the prompt's, by kind; the outputs."""
    kinds: dict[str, list[float]] = {"speculating": [], "plain": []}
    outputs = []
    spec = engine.speculator
    for r in requests:
        engine.add_request(r)
        tokens: list[int] = []
        first = True
        while engine.has_unfinished():
            verified = spec.counters.steps if spec is not None else 0
            if profile is not None:
                profile.enable()
            t0 = time.perf_counter()
            for out in engine.step():
                tokens += out.token_ids
            wall = time.perf_counter() - t0
            if profile is not None:
                profile.disable()
            if first:  # the prompt's step
                first = False
                continue
            kinds["speculating" if spec is not None and spec.counters.steps > verified else "plain"].append(wall)
        outputs.append(tokens)
    return kinds, outputs


def _record(engine: LLMEngine, requests: list[EngineRequest]) -> tuple[list[list[int]], list[list[int]]]:
    """The real run: every sampler call's tokens, and the outputs."""
    runner = engine.runner
    sampler = runner.sampler
    chosen: list[list[int]] = []

    def recording(logits: torch.Tensor, batch: Any) -> SamplerOutput:
        out = sampler(logits, batch)
        chosen.append(out.token_ids.tolist())
        return out

    runner.sampler = recording  # type: ignore[assignment]
    _, outputs = _decode(engine, requests)
    runner.sampler = sampler
    return chosen, outputs


def _stub_model(engine: LLMEngine, chosen: list[list[int]]) -> None:
    """Forward, logits and sampler that cost microseconds and give back the recorded tokens."""
    runner = engine.runner
    device = engine.device
    hidden = torch.zeros(4096, 8, device=device)  # [T, 8]: only its rows are indexed
    calls = iter(chosen)

    def forward(inputs: Any) -> torch.Tensor:
        return hidden[: inputs.input_ids.shape[0]]

    def sample_logits(h: torch.Tensor, inputs: Any) -> torch.Tensor:
        return hidden[: len(inputs.plan.sample_rows)]

    def sampler(logits: torch.Tensor, batch: Any) -> SamplerOutput:
        ids = runner.stager.to_device(next(calls), torch.int64)  # pinned: no wait for the device
        return SamplerOutput(ids, torch.zeros(ids.shape, device=device), torch.ones(ids.shape, dtype=torch.bool,
                                                                                  device=device), None, None)

    runner.forward = forward  # type: ignore[method-assign]
    runner.sample_logits = sample_logits  # type: ignore[method-assign,assignment]
    runner.sampler = sampler  # type: ignore[assignment]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-id", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--speculate", type=int, default=4)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="cProfile one more replay and print the host path's top")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    config = EngineConfig(model_id=args.model_id, device=args.device, dtype=args.dtype, speculate=args.speculate)
    requests = _requests(c3_prompts(resolve_model_dir(args.model_id))[: args.requests], args.new)
    engine = LLMEngine(config)
    with startup_objects_frozen():  # as in the server: no full collection inside a step
        chosen, outputs = _record(engine, requests)
    spec = engine.speculator
    acceptance = spec.counters.accepted_tokens / spec.counters.draft_tokens if spec and spec.counters.draft_tokens \
        else 0.0
    load = os.getloadavg()
    runs: list[dict[str, list[float]]] = []
    replay_config = replace(config, warmup=False)
    for i in range(args.repeat + (1 if args.profile else 0)):
        gc.collect()
        replay = LLMEngine(replay_config)
        _stub_model(replay, chosen)
        profile = cProfile.Profile() if args.profile and i == args.repeat else None
        with startup_objects_frozen():
            kinds, replayed = _decode(replay, requests, profile)
        assert replayed == outputs, "the replay did not take the recorded run's steps"
        if profile is None:
            runs.append(kinds)
        else:
            text = io.StringIO()
            stats = pstats.Stats(profile, stream=text).sort_stats("tottime")
            stats.print_stats(45)  # everything (the stubs cost next to nothing)
            stats.sort_stats("cumtime").print_stats(_HOST, 30)  # the host path's own functions
            print(text.getvalue())
    steps: dict[str, Any] = {}
    for kind in ("speculating", "plain"):
        medians = [statistics.median(r[kind]) for r in runs if r[kind]]
        if medians:
            steps[kind] = {"steps": len(runs[0][kind]), "host_us_median": 1e6 * statistics.median(medians),
                           "host_us_best": 1e6 * min(medians),  # the least disturbed replay (a shared machine)
                           "host_us_per_replay": [round(1e6 * m, 1) for m in medians]}
    result = {"command": "python scripts/profile_speculation.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v not in (None, False)),
              "load_average": [round(x, 2) for x in load], "acceptance": acceptance, "host": steps}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
