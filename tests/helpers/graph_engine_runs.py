"""Greedy runs of an engine on CUDA with CUDA-graph decode, for the GPU tests.

* :func:`graph_decode_tokens`: the tokens, for tests that compare a kernel switch off and on (the
  caller sets the switch before calling): one request alone first (the batch-1 graphs), then four
  together (batch 4), 24 new tokens each, EOS ignored.
* :func:`check_against_transformers`: requests decoded together in float32, each chosen token an
  argmax of transformers' logits and its logprob theirs, within stated bounds."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch


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


def check_against_transformers(model_dir: Path, hf: Any, *, lengths: tuple[int, ...], new_tokens: int, seed: int,
                               cuda_graphs: tuple[int, ...], label: str, tie_tol: float = 2e-3,
                               logprob_tol: float = 2e-3) -> None:
    """Serve ``model_dir`` in float32 on CUDA (the paged backend, CUDA-graph decode), random prompts
    of ``lengths`` decoded together, EOS ignored; then for each request every chosen token is within
    ``tie_tol`` of the best of ``hf``'s logits (a transformers model on the same weights) and its
    logprobs within ``logprob_tol`` of theirs."""
    from loom.config import EngineConfig
    from loom.engine.llm_engine import LLMEngine
    from loom.engine.types import EngineRequest, SamplingParams, StoppingParams

    engine = LLMEngine(EngineConfig(model_id=str(model_dir), device="cuda", dtype="float32",
                                    attention_backend="paged", block_size=16, max_batch_total_tokens=4096,
                                    cuda_graphs=cuda_graphs))
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in lengths]
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", tuple(p), SamplingParams(),
                                         StoppingParams(max_new_tokens=new_tokens, ignore_eos=True)))
    outs: dict[str, list[Any]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
    runner: Any = engine.worker.runner
    assert runner.cuda_graphs is not None and runner.cuda_graphs.num_replays > 0
    for i, p in enumerate(prompts):
        tokens = [t for o in outs[f"r{i}"] for t in o.token_ids]
        logprobs = [lp for o in outs[f"r{i}"] for lp in o.logprobs]
        with torch.no_grad():
            logits = hf(torch.tensor([p + tokens])).logits[0, len(p) - 1: -1].float()  # [new_tokens, V]
        chosen = logits[torch.arange(len(tokens)), tokens]
        assert (logits.max(-1).values - chosen).max().item() <= tie_tol, f"{label} r{i}: a chosen token is not an argmax"
        ref = logits.log_softmax(-1)[torch.arange(len(tokens)), tokens]
        assert torch.allclose(torch.tensor(logprobs), ref, atol=logprob_tol), f"{label} r{i}: logprobs"
