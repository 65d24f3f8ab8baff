"""On a real GPU, nothing compiles after the engine is ready when a quantized draft model
speculates: W5 b in miniature (a random-weight target, its int4 copy as the draft, every draft
rejected, back-offs of 4..64 steps and catch-ups of 5..65 tokens), then the draft driven
directly with catch-ups of every size, mixed over up to three sequences. Triton's JIT cache
hook sees every compile (or load from its disk cache) in the process; none may happen."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_nothing_compiles_after_the_draft_model_warmed_up() -> None:
    from triton import knobs

    from loom.config import EngineConfig
    from loom.engine.llm_engine import LLMEngine
    from loom.engine.types import EngineRequest, SamplingParams, StoppingParams
    from loom.plugin_api import DraftRequest
    from loom_plugins.speculative.draft_model import DraftModelProposer

    engine = LLMEngine(EngineConfig(model_id="random:tiny-llama", device="cuda", dtype="bfloat16",
                                    max_batch_total_tokens=16384, speculate=3, speculator="draft",
                                    speculator_options=(("model_id", "random:tiny-llama"), ("quantize", "gptq"),
                                                        ("kv_tokens", "8192"))))
    assert engine.speculator is not None
    proposer = engine.speculator.proposer
    assert isinstance(proposer, DraftModelProposer)
    repacked = [m for m in proposer.worker.model.modules() if "w4a16" in m.__dict__]  # type: ignore[attr-defined]
    assert repacked, "the draft's layers are not on the W4A16 kernels: nothing tested"
    compiled: list[str] = []

    def hook(**kwargs: Any) -> bool:
        compiled.append(str(kwargs.get("repr", "?")))
        return False  # compile as usual: only record it

    knobs.runtime.jit_cache_hook = hook
    try:
        engine.add_request(EngineRequest("w5b", tuple(range(10, 60)), SamplingParams(),
                                         StoppingParams(max_new_tokens=200, ignore_eos=True)))
        while engine.has_unfinished():
            engine.step()
        c = engine.speculator.counters
        assert c.verifications >= 6  # the back-offs ended, catch-ups followed
        rng = random.Random(0)
        tokens: dict[int, list[int]] = {}
        for _ in range(60):
            live = rng.sample(range(5), rng.randint(1, 3))
            for sid in live:
                seq = tokens.setdefault(100 + sid, [rng.randrange(3, 1000) for _ in range(rng.randint(1, 200))])
                seq += [rng.randrange(3, 1000) for _ in range(rng.choice([1, 2, 3, 7, 16, 31, 48, 64, 99, 120, 300]))]
                if len(seq) > 1000:
                    proposer.release(100 + sid)
                    tokens[100 + sid] = seq[-rng.randint(1, 300):]
            proposer.propose([DraftRequest(100 + sid, tokens[100 + sid], 3) for sid in live])
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_cache_hook = None
    assert not compiled, f"{len(compiled)} kernel(s) compiled while serving:\n" + "\n".join(compiled)
