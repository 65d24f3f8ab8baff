"""Greedy tokens of an engine on CUDA with CUDA-graph decode, for the GPU tests that compare a kernel
switch off and on (the caller sets the switch before calling): one request alone first (the
batch-1 graphs), then four together (batch 4), 24 new tokens each, EOS ignored."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any


def graph_decode_tokens(model_dir: Path, kv_cache_dtype: str = "auto", seed: int = 11) -> dict[str, list[int]]:
    from loom.config import EngineConfig
    from loom.engine.llm_engine import LLMEngine
    from loom.engine.types import EngineRequest, SamplingParams, StoppingParams

    engine = LLMEngine(EngineConfig(model_id=str(model_dir), device="cuda", dtype="bfloat16",
                                    attention_backend="paged", block_size=16, max_batch_total_tokens=4096,
                                    cuda_graphs=(1, 4), kv_cache_dtype=kv_cache_dtype))
    rng = random.Random(seed)
    prompts = [tuple(rng.randrange(3, 320) for _ in range(n)) for n in (37, 5, 90, 12)]
    tokens: dict[str, list[int]] = {}
    for batch in ([0], [0, 1, 2, 3]):
        for i in batch:
            engine.add_request(EngineRequest(f"b{len(batch)}-r{i}", prompts[i], SamplingParams(),
                                             StoppingParams(max_new_tokens=24, ignore_eos=True)))
        while engine.has_unfinished():
            for o in engine.step():
                tokens.setdefault(o.request_id, []).extend(o.token_ids)
    runner: Any = engine.worker.runner
    assert runner.cuda_graphs is not None and runner.cuda_graphs.num_replays > 0
    return tokens
