"""Loom's side of a benchmark: all requests submitted at once to the engine process."""

from __future__ import annotations

import asyncio
import statistics
import time

from loom.engine.core_process import AsyncEngineClient
from loom.engine.types import EngineRequest, SamplingParams, StoppingParams

from .workloads import Workload


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


async def run_engine_workload(client: AsyncEngineClient, w: Workload, tag: str = "") -> dict[str, float]:
    """Submit every request of ``w`` at once; wall time from first submit to last token."""

    async def one(i: int, prompt: list[int], new: int, t0: float) -> tuple[float, list[float]]:
        req = EngineRequest(f"{tag}{w.name}-{i}", tuple(prompt), SamplingParams(),
                            StoppingParams(max_new_tokens=new, ignore_eos=True))
        stamps: list[float] = []
        async for out in client.generate(req):
            stamps.extend([time.perf_counter()] * len(out.token_ids))
        assert len(stamps) == new, f"request {i} generated {len(stamps)} of {new} tokens"
        return stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:], strict=False)]

    # warm-up: one short request so lazy initialisation is not timed
    warm = EngineRequest(f"{tag}warm-{w.name}", tuple(w.requests[0][0][:8]), SamplingParams(),
                         StoppingParams(max_new_tokens=2, ignore_eos=True))
    async for _ in client.generate(warm):
        pass
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i, p, n, t0) for i, (p, n) in enumerate(w.requests)))
    dt = time.perf_counter() - t0
    ttft = [r[0] for r in results]
    itl = [x for r in results for x in r[1]]
    return {
        "s": dt,
        "out_tokens": w.output_tokens,
        "out_tok_s": w.output_tokens / dt,
        "total_tok_s": (w.output_tokens + w.prompt_tokens) / dt,
        "ttft_p50_s": _percentile(ttft, 0.5),
        "itl_mean_s": statistics.fmean(itl) if itl else 0.0,
        "itl_p99_s": _percentile(itl, 0.99),
    }
