"""Loom's side of a benchmark: all requests submitted at once to the engine process."""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from collections.abc import Sequence
from typing import Any

from loom.engine.core_process import AsyncEngineClient
from loom.engine.types import EngineRequest, SamplingParams, StoppingParams

from .workloads import Workload


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def warmup_prompts(w: Workload, count: int = 4) -> list[list[int]]:
    """Prompts as long as the workload's first ones but with other ids, so a prefix cache cannot
    hand the timed run its prefill for free."""
    return [[(t + 7) % 990 + 10 for t in p] for p, _ in w.requests[:count]]


async def _drain(client: AsyncEngineClient, req: EngineRequest) -> None:
    async for _ in client.generate(req):
        pass


async def warm_up(client: AsyncEngineClient, w: Workload, tag: str = "", full: bool = False) -> None:
    """One short request so lazy initialisation is not timed; with ``full``, also a few requests
    shaped like the workload's (long prefills, a small decode batch: kernels compile on first use)."""
    await _drain(client, EngineRequest(f"{tag}warm-{w.name}", tuple(w.requests[0][0][:8]), SamplingParams(),
                                       StoppingParams(max_new_tokens=2, ignore_eos=True)))
    if full:
        await asyncio.gather(*(
            _drain(client, EngineRequest(f"{tag}warm-{w.name}-{i}", tuple(p), SamplingParams(),
                                         StoppingParams(max_new_tokens=4, ignore_eos=True)))
            for i, p in enumerate(warmup_prompts(w))
        ))


async def run_engine_workload(client: AsyncEngineClient, w: Workload, tag: str = "",
                              full_warmup: bool = False, adapters: Sequence[str] = ()) -> dict[str, Any]:
    """Submit every request of ``w`` at once; wall time from first submit to last token.
    ``adapters``: request i uses LoRA adapter ``adapters[i % len(adapters)]`` ("" the base model)."""

    drafts = [0, 0, 0]  # the proposer's drafts verified, accepted, and the messages that carried them

    async def one(i: int, prompt: list[int], new: int, t0: float) -> tuple[float, list[float]]:
        req = EngineRequest(f"{tag}{w.name}-{i}", tuple(prompt), SamplingParams(),
                            StoppingParams(max_new_tokens=new, ignore_eos=True),
                            adapter_id=adapters[i % len(adapters)] if adapters else "")
        stamps: list[float] = []
        async for out in client.generate(req):
            if out.error:
                raise RuntimeError(f"request {i} failed in the engine: {out.error}")
            stamps.extend([time.perf_counter()] * len(out.token_ids))
            if out.num_draft_tokens:
                drafts[0] += out.num_draft_tokens
                drafts[1] += out.num_accepted_draft_tokens
                drafts[2] += 1
        assert len(stamps) == new, f"request {i} generated {len(stamps)} of {new} tokens"
        return stamps[0] - t0, [b - a for a, b in itertools.pairwise(stamps)]

    await warm_up(client, w, tag, full_warmup)
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
        "ttft_p99_s": _percentile(ttft, 0.99),
        "itl_mean_s": statistics.fmean(itl) if itl else 0.0,
        "itl_p99_s": _percentile(itl, 0.99),
        **({"speculation": {"draft_tokens": drafts[0], "accepted_tokens": drafts[1],
                            "acceptance": drafts[1] / drafts[0], "verifying_outputs": drafts[2]}}
           if drafts[0] else {}),
    }
