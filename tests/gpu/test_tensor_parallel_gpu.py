"""Tensor parallelism on GPUs (NCCL): the sharded worker's path gives one plain worker's tokens.

- World size 1 on one GPU: the engine drives a :class:`ShardedWorker` (NCCL process group, the
  gloo control group, commands broadcast, CUDA graphs captured through it) and must match the
  plain worker exactly (one rank: the collectives return their input).
- Two GPUs (skipped with fewer): ``num_shard=2``, rank 1 a process of its own on the second
  visible GPU; greedy and seeded tokens equal one GPU's (float32, a tiny model with peaked logits).

Not run in this branch's CI (no GPU time); written against the same calls as the CPU tests.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _workload() -> list[Any]:
    from loom.engine.types import EngineRequest, SamplingParams, StoppingParams

    stop = StoppingParams(max_new_tokens=24, ignore_eos=True)
    return [EngineRequest(f"g{i}", tuple(range(3 + i, 20 + 2 * i)), SamplingParams(), stop) for i in range(6)] + [
        EngineRequest(f"s{i}", (7, 8, 9 + i), SamplingParams(do_sample=True, temperature=0.9, top_p=0.9, seed=i),
                      stop) for i in range(4)]


def _run(engine: Any) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for req in _workload():
        engine.add_request(req)
    while engine.has_unfinished():
        for o in engine.step():
            assert o.error is None, o.error
            out.setdefault(f"{o.request_id}/{o.index}", []).extend(o.token_ids)
    return out


def _config(path: Path, **kw: Any) -> Any:
    from loom.config import EngineConfig

    return EngineConfig(model_id=str(path), device="cuda", dtype="float32", block_size=16,
                        max_batch_total_tokens=4096, cuda_graphs=(1, 2, 4, 8, 16), **kw)


def test_sharded_worker_of_one_rank_on_nccl_matches_the_plain_worker(tiny_model_dir: Callable[[str], Path],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import loom.engine.llm_engine as llm_engine
    from loom.worker.sharded_worker import ShardedWorker

    path = tiny_model_dir("llama")
    ref = _run(llm_engine.LLMEngine(_config(path)))
    monkeypatch.setattr(llm_engine, "Worker", lambda config, registry: ShardedWorker(config, registry))
    engine = llm_engine.LLMEngine(_config(path))
    try:
        assert isinstance(engine.worker, ShardedWorker)
        assert torch.distributed.get_backend() == "nccl"
        assert engine.worker.max_graph_batch_size == 16  # graphs captured through the broadcast
        assert _run(engine) == ref
    finally:
        engine.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_give_one_gpus_tokens(tiny_model_dir: Callable[[str], Path]) -> None:
    from loom.engine.llm_engine import LLMEngine

    path = tiny_model_dir("llama")
    ref = _run(LLMEngine(_config(path)))
    engine = LLMEngine(_config(path, num_shard=2))
    try:
        assert _run(engine) == ref
        assert engine.info.num_shard == 2
    finally:
        engine.close()
