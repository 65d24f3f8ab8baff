"""On a real GPU, speculative decoding gives the tokens of plain decoding: the paged backend,
verification steps of query length k + 1 replayed from CUDA graphs (drafts padded to k), mixed
with prefill chunks and plain decode rows, greedy and seeded sampling; the n-gram proposer and
a proposer that knows the answer and lies on purpose.

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


@pytest.mark.parametrize("speculator", ["ngram", "oracle"])
def test_speculation_equals_plain_decoding_on_cuda(tiny_model_dir: Callable[[str], Path], speculator: str) -> None:
    from helpers.oracle_proposer import LIES, REFERENCE, registry

    from loom.config import EngineConfig
    from loom.engine.llm_engine import LLMEngine
    from loom.engine.types import EngineRequest, SamplingParams, StoppingParams

    rng = random.Random(7)
    reqs = []
    for i in range(12):
        body = [rng.randrange(3, 320) for _ in range(rng.randint(2, 12))]
        prompt = tuple(body * rng.randint(1, 5))  # repeats: the n-gram proposer finds matches
        sampling = SamplingParams(do_sample=True, seed=i, temperature=0.9, top_p=0.9) if i % 3 == 0 else SamplingParams()
        reqs.append(EngineRequest(f"r{i}", prompt, sampling,
                                  StoppingParams(max_new_tokens=rng.randint(4, 48), ignore_eos=True)))

    def run(speculate: int) -> tuple[dict[str, list[int]], LLMEngine]:
        engine = LLMEngine(EngineConfig(model_id=str(tiny_model_dir("llama")), device="cuda", dtype="float32",
                                        attention_backend="paged", block_size=16, max_batch_total_tokens=8192,
                                        cuda_graphs=(1, 2, 4, 8, 16), speculate=speculate, speculator=speculator),
                           registry())
        tokens: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        for r in reqs:
            engine.add_request(r)
        while engine.has_unfinished():
            for o in engine.step():
                tokens[o.request_id] += o.token_ids
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        return tokens, engine

    plain, _ = run(0)
    REFERENCE.clear()
    for r in reqs:
        REFERENCE[r.prompt_token_ids] = plain[r.request_id]
    LIES["rate"] = 0.3
    spec, engine = run(4)
    assert spec == plain
    assert engine.speculator is not None and engine.speculator.counters.accepted_tokens > 0
    assert engine.graph_query_lens == (1, 5)
    graphs = engine.runner.cuda_graphs
    assert graphs is not None and 5 in graphs.captured_query_lens and graphs.num_replays > 0
