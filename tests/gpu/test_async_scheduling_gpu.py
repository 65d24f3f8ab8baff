"""On a real GPU, asynchronous scheduling (step N+1 prepared and launched before step N's tokens
are read back, its inputs taken from N's sampled ids on the device) gives the tokens of
synchronous scheduling, with CUDA-graph decode and the paged backend, on a mixed workload.

A tiny Llama in float32: no near-ties between two equally valid argmaxes, so equality is exact.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_async_equals_sync_on_cuda(tiny_model_dir: Callable[[str], Path]) -> None:
    from loom.config import EngineConfig
    from loom.engine.llm_engine import LLMEngine
    from loom.engine.types import EngineRequest, SamplingParams, StoppingParams

    rng = random.Random(5)
    reqs = []
    for i in range(24):
        prompt = tuple(rng.randrange(3, 320) for _ in range(rng.randint(2, 90)))
        sampling = SamplingParams(do_sample=True, seed=i, temperature=0.9, top_p=0.9) if i % 3 == 0 else SamplingParams()
        reqs.append(EngineRequest(f"r{i}", prompt, sampling,
                                  StoppingParams(max_new_tokens=rng.randint(1, 40), ignore_eos=i % 2 == 0)))
    arrivals = {f"r{i}": rng.randint(0, 20) for i in range(24)}

    def run(mode: str) -> tuple[dict[str, list[int]], LLMEngine]:
        engine = LLMEngine(EngineConfig(model_id=str(tiny_model_dir("llama")), device="cuda", dtype="float32",
                                        attention_backend="paged", block_size=16, max_batch_total_tokens=8192,
                                        async_scheduling=mode, cuda_graphs=(1, 2, 4, 8, 16, 32)))
        pending = sorted(reqs, key=lambda r: arrivals[r.request_id])
        tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        step = 0
        while pending or engine.has_unfinished():
            while pending and arrivals[pending[0].request_id] <= step:
                engine.add_request(pending.pop(0))
            for o in engine.step():
                tokens[o.request_id] += o.token_ids
            step += 1
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        return tokens, engine

    sync, _ = run("off")
    asyn, engine = run("on")
    assert engine.num_async_steps > 0
    assert engine.runner.cuda_graphs is not None and engine.runner.cuda_graphs.num_replays > 0
    assert asyn == sync
