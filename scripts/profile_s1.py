"""Where S1's time goes inside the engine (#17): its requests stepped in-process, with and without
their grammars, each arm's step times and a cProfile of its host work.

S1 (``loom bench --workloads S1``) runs through the engine's core process, so its pairs include the
client and the process boundary; here the same 64 requests (S1's schemas and prompts, each request
its own prompt) go straight to an :class:`LLMEngine`, so what differs between the arms is the
engine's own work. Per arm: the wall time, the steps, the step times (median and the first steps),
and the 25 functions with the most own time. The unconstrained arm generates, per request, as
many tokens as its constrained run did (``ignore_eos``), as S1 does.

With the grammar process (``--grammar-process on``, what ``auto`` picks on CUDA), each pair also
reports how often and how long the engine's thread waited for the child's rows, and the child's
own time a step and its full garbage collections.

    python3 scripts/profile_s1.py [--device cuda] [--requests 64] [--new-tokens 128]
        [--grammar-process auto|on|off] [--out FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))

from loom.bench.structured import SCHEMAS, request_prompt
from loom.config import EngineConfig
from loom.engine.llm_engine import LLMEngine
from loom.engine.types import EngineRequest, SamplingParams, StoppingParams
from loom.frontend.tokenizer import Tokenizer
from loom.model_loader import resolve_model_dir
from loom.structured.spec import GrammarSpec


def _spec(name: str) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(SCHEMAS[name]), "parameters.constraint.json_schema")


def _run(engine: LLMEngine, requests: list[EngineRequest], profile: bool, sync: object) -> dict[str, object]:
    """Step ``requests`` to the end; the step times, the tokens of each request, and a profile."""
    for r in requests:
        engine.add_request(r)
    counts = {r.request_id: 0 for r in requests}
    steps: list[float] = []
    prof = cProfile.Profile() if profile else None
    started = time.perf_counter()
    if prof:
        prof.enable()
    while engine.has_unfinished():
        t = time.perf_counter()
        for out in engine.step():
            counts[out.request_id] += len(out.token_ids)
        steps.append(time.perf_counter() - t)
    if prof:
        prof.disable()
    sync()  # type: ignore[operator]
    wall = time.perf_counter() - started
    text = ""
    if prof:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        text = buf.getvalue()
    ms = sorted(s * 1e3 for s in steps)
    median = statistics.median(ms) if ms else 0.0

    def pct(q: float) -> float:
        return round(ms[min(len(ms) - 1, int(q * len(ms)))], 3) if ms else 0.0

    return {"wall_s": wall, "steps": len(steps), "tokens": sum(counts.values()), "counts": counts,
            "step_ms_median": median, "step_ms_p90": pct(0.9), "step_ms_p99": pct(0.99), "step_ms_max": pct(1.0),
            "steps_over_2x_median": sum(1 for x in ms if x > 2 * median),
            "ms_over_2x_median": round(sum(x - median for x in ms if x > 2 * median), 2),
            "first_steps_ms": [round(x, 2) for x in [s * 1e3 for s in steps][:6]], "profile": text}


def _grammar_stats(engine: LLMEngine) -> dict[str, float]:
    """The grammar process's counters so far (empty with the in-process driver)."""
    from loom.structured.grammar_process import GrammarProcess

    driver = engine._structured
    if not isinstance(driver, GrammarProcess):
        return {}
    out: dict[str, float] = {f"engine_{k}": v for k, v in dataclasses.asdict(driver.waits).items()}
    child = driver.child_stats()
    if child is not None:
        out.update({f"child_{k}": v for k, v in dataclasses.asdict(child).items()})
    return out


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: round(v if k.startswith(("engine_max", "child_max")) else v - before.get(k, 0.0), 5)
            for k, v in after.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed pairs (the profile is of the last)")
    parser.add_argument("--grammar-process", default="auto", choices=("auto", "on", "off"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cfg = EngineConfig(device=args.device, dtype="bfloat16" if args.device != "cpu" else "auto",
                       max_total_tokens=512, max_batch_prefill_tokens=4096, grammar_process=args.grammar_process)
    engine = LLMEngine(cfg)
    on_cuda = engine.device.type == "cuda"

    def sync() -> None:
        if on_cuda:
            import torch
            torch.cuda.synchronize()

    tokenizer = Tokenizer.from_model_dir(Path(resolve_model_dir(cfg.model_id)))
    names = [list(SCHEMAS)[i % len(SCHEMAS)] for i in range(args.requests)]
    prompts = [tuple(tokenizer.encode_chat([{"role": "system", "content": "Answer with JSON only."},
                                            {"role": "user", "content": request_prompt(n, i, False)}]))
               for i, n in enumerate(names)]
    pairs = []
    report = []
    for r in range(-1, args.repeats):  # an untimed pair first: grammars compiled, graphs captured
        last = r == args.repeats - 1
        before = _grammar_stats(engine)
        with_g = _run(engine, [EngineRequest(f"g{r}-{i}", p, SamplingParams(constraint=_spec(n)),
                                             StoppingParams(max_new_tokens=args.new_tokens))
                               for i, (p, n) in enumerate(zip(prompts, names, strict=True))], last, sync)
        grammar = _delta(_grammar_stats(engine), before)
        counts = list(with_g["counts"].values())  # type: ignore[attr-defined]
        without = _run(engine, [EngineRequest(f"u{r}-{i}", p, SamplingParams(),
                                              StoppingParams(max_new_tokens=c, ignore_eos=True))
                                for i, (p, c) in enumerate(zip(prompts, counts, strict=True))], last, sync)
        if r < 0:
            continue
        pair = {"ratio": without["wall_s"] / with_g["wall_s"],  # type: ignore[operator]
                **{f"{k}_{arm}": v[k] for arm, v in (("grammar", with_g), ("plain", without))
                   for k in ("wall_s", "steps", "tokens", "step_ms_median", "step_ms_p90", "step_ms_p99",
                             "step_ms_max", "steps_over_2x_median", "ms_over_2x_median", "first_steps_ms")},
                **grammar}
        pairs.append(pair)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in pair.items()}), flush=True)
        if last:
            report = [f"== with grammars (pair {r})\n{with_g['profile']}", f"== without (pair {r})\n{without['profile']}"]
    summary = {"device": str(engine.device), "requests": args.requests, "grammar_process": args.grammar_process,
               "ratio_total": sum(p["wall_s_plain"] for p in pairs) / sum(p["wall_s_grammar"] for p in pairs), "pairs": pairs}
    print(f"ratio (all pairs' time, without over with): {summary['ratio_total']:.3f}")
    print("\n".join(report))
    if args.out:
        args.out.write_text(json.dumps({**summary, "profiles": report}, indent=1) + "\n")
    engine.close()


if __name__ == "__main__":
    main()
