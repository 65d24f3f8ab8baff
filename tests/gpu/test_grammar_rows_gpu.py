"""On a real GPU, structured output's rows as the engine hands them over since #17: filled in
pinned host buffers (copied to the device straight from them, no staging copy) and, with
asynchronous scheduling, on the driver's fill thread while the previous step's outputs are
processed. Both must change no mask: the same logits come out of the processor, and a
constrained run gives the same tokens with the fill thread and pinned rows as without."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("xgrammar")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_pinned_rows_mask_as_staged_rows_do() -> None:
    from loom.sample.batch import TokenBitmaskRows, token_bitmask
    from loom.worker.staging import Stager

    stage = Stager(torch.device("cuda"))
    gen = torch.Generator().manual_seed(0)
    words = 1536  # SmolLM2's 49,152 tokens
    buffers = [torch.empty(64, words, dtype=torch.int32, pin_memory=True) for _ in range(2)]
    for step in range(6):  # the driver's two buffers in turn, refilled after the step was read back
        stage.next_step()
        host = buffers[step % 2]
        host.copy_(torch.randint(-2**31, 2**31 - 1, (64, words), dtype=torch.int32, generator=gen))
        logits = torch.randn(64, words * 32, device="cuda")
        pinned = token_bitmask(TokenBitmaskRows(list(range(64)), words, host, pinned=True), stage, 64)
        staged = token_bitmask(TokenBitmaskRows(list(range(64)), words, host.clone()), stage, 64)
        got, want = pinned(logits.clone()), staged(logits.clone())
        torch.cuda.synchronize()
        assert torch.equal(got, want), step


def test_fill_thread_and_pinned_rows_change_no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2 (the bundled GGUF, bf16), 32 requests with S1's schemas, greedy, async scheduling."""
    from loom import kernel_switches
    from loom.bench.structured import SCHEMAS
    from loom.config import EngineConfig
    from loom.engine.llm_engine import LLMEngine
    from loom.engine.types import EngineRequest, SamplingParams, StoppingParams
    from loom.model_loader import resolve_model_dir
    from loom.structured.spec import GrammarSpec

    model = resolve_model_dir(None)
    specs = [GrammarSpec("json_schema", json.dumps(s), "parameters.constraint.json_schema") for s in SCHEMAS.values()]

    def run(fill_thread: bool) -> tuple[dict[str, list[int]], int]:
        monkeypatch.setattr(kernel_switches, "grammar_fill_thread", fill_thread)
        engine = LLMEngine(EngineConfig(model_id=str(model), device="cuda", dtype="bfloat16", max_total_tokens=512,
                                        max_batch_total_tokens=32768, async_scheduling="on", warmup=False,
                                        cuda_graphs=(8, 16, 32)))
        for i in range(32):
            engine.add_request(EngineRequest(f"r{i}", (1, 504, 3458, 28, 253 + i), SamplingParams(constraint=specs[i % 8]),
                                             StoppingParams(max_new_tokens=48)))
        out: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.token_ids)
        assert engine._structured is not None and engine._structured.pin_memory
        return out, engine._structured.num_filled_ahead

    with_thread, ahead = run(True)
    without, none_ahead = run(False)
    assert with_thread == without
    assert ahead > 10 and none_ahead == 0
