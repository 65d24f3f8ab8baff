"""generate_chunks / coalesced / collect_completions against a scripted fake engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from loom.engine.types import EngineOutput, EngineRequest, FinishReason, SamplingParams
from loom.frontend.coalesce import coalesced
from loom.frontend.completion import EngineRequestError, TextOptions
from loom.frontend.generation import GenerationPlan, collect_completions, generate_chunks
from loom.frontend.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(default_model_dir)


class FakeEngine:
    """Yields scripted outputs, ``delay`` seconds apart; records whether the stream was closed early."""

    def __init__(self, outputs: list[EngineOutput], delay: float = 0.0) -> None:
        self.outputs = outputs
        self.delay = delay
        self.closed_early = False
        self.sent = 0

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        try:
            for out in self.outputs:
                if self.delay:
                    await asyncio.sleep(self.delay)
                self.sent += 1
                yield out
        finally:
            self.closed_early = self.sent < len(self.outputs)


def outs(tok: Tokenizer, text: str, index: int = 0, lp: float = -1.0, finish: FinishReason = FinishReason.LENGTH) -> list[EngineOutput]:
    ids = tok.encode(text, add_special_tokens=False)
    return [EngineOutput("r", index, [t], [lp], finish_reason=finish if i == len(ids) - 1 else None, seed=7)
            for i, t in enumerate(ids)]


def plan(n: int = 1, best_of: int = 1, **kw: object) -> GenerationPlan:
    req = EngineRequest("r", (1, 2, 3), SamplingParams(do_sample=best_of > 1), n=best_of)
    return GenerationPlan(req, n=n, **kw)  # type: ignore[arg-type]


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


def test_chunks_concatenate_to_the_text(tok: Tokenizer) -> None:
    engine = FakeEngine(outs(tok, "The capital of France is Paris."))

    async def go() -> str:
        return "".join([c.text async for c in generate_chunks(engine, tok, plan())])

    assert run(go()) == "The capital of France is Paris."


def test_stop_string_closes_the_engine_stream(tok: Tokenizer) -> None:
    engine = FakeEngine(outs(tok, "one two three four five six"))
    p = plan(text=TextOptions(stop_sequences=(" three",)))
    result = run(collect_completions(generate_chunks(engine, tok, p), p))
    assert result.completions[0].text == "one two"  # type: ignore[attr-defined]
    assert result.completions[0].finish_reason is FinishReason.STOP_SEQUENCE  # type: ignore[attr-defined]
    assert engine.closed_early


def test_a_completion_ended_by_a_stop_string_is_stopped_in_the_engine(tok: Tokenizer) -> None:
    class RecordingEngine(FakeEngine):
        def __init__(self, outputs: list[EngineOutput]) -> None:
            super().__init__(outputs)
            self.stopped: list[tuple[str, int]] = []

        def abort_completion(self, request_id: str, index: int) -> None:
            self.stopped.append((request_id, index))

    # Completion 0 hits " three" early; completion 1 runs to its end. Interleaved, as the engine sends.
    a, b = outs(tok, "one two three four five six", 0), outs(tok, "alpha beta gamma delta", 1)
    script = [x for pair in zip(a, b, strict=False) for x in pair] + a[len(b):] + b[len(a):]
    engine = RecordingEngine(script)
    p = plan(n=2, best_of=2, text=TextOptions(stop_sequences=(" three",)))
    result = run(collect_completions(generate_chunks(engine, tok, p), p))
    texts = {c.index: c.text for c in result.completions}  # type: ignore[attr-defined]
    assert texts == {0: "one two", 1: "alpha beta gamma delta"}
    assert engine.stopped == [("r", 0)]  # once, for the completion the stop string ended


def test_engine_abort_completion_frees_its_blocks_only(tiny_model_dir: object) -> None:
    from loom.config import EngineConfig
    from loom.engine.llm_engine import LLMEngine
    from loom.engine.types import StoppingParams

    engine = LLMEngine(EngineConfig(model_id=str(tiny_model_dir("llama")), block_size=4,  # type: ignore[operator]
                                    max_batch_total_tokens=512))
    engine.add_request(EngineRequest("n3", tuple(range(10, 23)), SamplingParams(do_sample=True, seed=3),
                                     StoppingParams(max_new_tokens=12, ignore_eos=True), n=3))
    counts = {0: 0, 1: 0, 2: 0}
    for step in range(12):
        if step == 3:
            engine.abort_completion("n3", 1)
        for o in engine.step():
            counts[o.index] += len(o.token_ids)
    assert counts[0] == counts[2] == 12 and counts[1] == 3
    assert not engine.has_unfinished() and not engine.requests
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_best_of_keeps_the_highest_cumulative_logprob(tok: Tokenizer) -> None:
    script = outs(tok, "bad answer", 0, lp=-3.0) + outs(tok, "good answer", 1, lp=-0.1)
    p = plan(n=1, best_of=2)
    result = run(collect_completions(generate_chunks(FakeEngine(script), tok, p), p))
    assert [(c.index, c.text) for c in result.completions] == [(0, "good answer")]  # type: ignore[attr-defined]
    assert result.generated_tokens == len(script)  # type: ignore[attr-defined]


def test_time_limit_finishes_every_completion(tok: Tokenizer) -> None:
    engine = FakeEngine(outs(tok, "a b c d e f g h i j"), delay=0.05)
    p = plan(time_limit_s=0.12)
    result = run(collect_completions(generate_chunks(engine, tok, p), p))
    c = result.completions[0]  # type: ignore[attr-defined]
    assert c.finish_reason is FinishReason.TIME_LIMIT and 0 < c.generated_tokens < 10
    assert engine.closed_early


def test_engine_error_raises(tok: Tokenizer) -> None:
    engine = FakeEngine([EngineOutput("r", 0, [], [], finish_reason=FinishReason.ERROR, error="boom")])
    p = plan()
    with pytest.raises(EngineRequestError, match="boom"):
        run(collect_completions(generate_chunks(engine, tok, p), p))


def test_coalesced_merges_ready_chunks_and_closing_aborts(tok: Tokenizer) -> None:
    engine = FakeEngine(outs(tok, "a b c d e f g h i j k l"))

    async def go() -> tuple[int, str]:
        batches, text = 0, ""
        async for batch in coalesced(generate_chunks(engine, tok, plan())):
            assert len(batch) == 1  # one completion: everything ready merges into one chunk
            batches += 1
            text += batch[0].text
            await asyncio.sleep(0.01)  # a slow writer: the pump runs ahead
        return batches, text

    batches, text = asyncio.run(go())
    assert text == "a b c d e f g h i j k l" and batches < 12

    slow = FakeEngine(outs(tok, "a b c d e f g h i j k l"), delay=0.02)

    async def cancel_midway() -> None:
        gen = coalesced(generate_chunks(slow, tok, plan()))
        await gen.__anext__()
        await gen.aclose()  # what a client cancel does to the handler's stream

    run(cancel_midway())
    assert slow.closed_early
