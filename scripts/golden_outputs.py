"""Golden outputs of the engine on CPU: record them before a restructuring, compare after.

Runs a fixed set of requests through the in-process engine and the front end's text pipeline
(the same ``generate_chunks`` / ``collect_completions`` the gRPC handlers use) for two models:
the real default SmolLM2-135M-Instruct (its GGUF blocks, ``--quantize auto``) and a random-weight
2-layer Llama with SmolLM2's vocabulary and tokenizer. The requests cover greedy and seeded
sampling with every warper and penalty, logprobs and top-n alternatives, prompt logprobs, n > 1
and best_of, stop strings and stop token ids, min_new_tokens, prefix-cache hits, chunked prefill
and preemption in a small pool. Floats are written as ``float.hex()`` so a comparison is exact.

    python scripts/golden_outputs.py            # write tests/golden/*.json
    python scripts/golden_outputs.py --check    # compare with the committed files; exit 1 on a difference

The files hold the bits of this machine's CPU kernels (and torch / MKL version): compare runs
made on one machine, one right after the other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GOLDEN_DIR = ROOT / "tests" / "golden"
sys.path.insert(0, str(ROOT / "tests"))
from helpers.source_tree import make_importable  # noqa: E402
from helpers.tiny_models import save_tiny_llama_with_vocab_of  # noqa: E402

make_importable()


from loom.config import EngineConfig  # noqa: E402
from loom.engine.llm_engine import LLMEngine  # noqa: E402
from loom.engine.types import EngineOutput, EngineRequest, SamplingParams, StoppingParams  # noqa: E402
from loom.frontend.completion import TextOptions, TokenInfo  # noqa: E402
from loom.frontend.generation import GenerationPlan, collect_completions, generate_chunks  # noqa: E402
from loom.frontend.tokenizer import Tokenizer  # noqa: E402


class InProcessEngine:
    """The engine client protocol over an in-process :class:`LLMEngine`: one driver task steps
    the engine while any request is open and routes each output to its request's queue."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._queues: dict[str, asyncio.Queue[EngineOutput]] = {}
        self._driver: asyncio.Task[None] | None = None

    async def _drive(self) -> None:
        while self._queues:
            for out in self.engine.step():
                q = self._queues.get(out.request_id)
                if q is not None:
                    q.put_nowait(out)
            await asyncio.sleep(0)
        self._driver = None

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        q: asyncio.Queue[EngineOutput] = asyncio.Queue()
        self._queues[request.request_id] = q
        self.engine.add_request(request)
        if self._driver is None:
            self._driver = asyncio.get_running_loop().create_task(self._drive())
        remaining = max(1, request.n)
        try:
            while remaining:
                out = await q.get()
                if out.finished:
                    remaining -= 1
                yield out
        finally:
            del self._queues[request.request_id]
            if remaining:
                self.engine.abort(request.request_id)

    def abort_completion(self, request_id: str, index: int) -> None:
        self.engine.abort_completion(request_id, index)


@dataclass(frozen=True)
class Case:
    name: str
    prompt: str  # text, or a user message rendered with the chat template when ``chat``
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stopping: StoppingParams = field(default_factory=lambda: StoppingParams(max_new_tokens=16))
    text: TextOptions = field(default_factory=TextOptions)
    n: int = 1
    best_of: int = 1
    prompt_logprobs: bool = False
    chat: bool = False


STORY = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
QUESTION = "What is the capital of France? Answer in one word."
LIST = "List three colours of the rainbow:\n1."
LONG = ("The history of weaving goes back thousands of years. " * 12).strip()
SEEDED: dict[str, Any] = dict(do_sample=True, seed=1234)

BATCH_CASES = [
    Case("greedy-story", STORY),
    Case("greedy-question", QUESTION, stopping=StoppingParams(max_new_tokens=12), chat=True),
    Case("greedy-logprobs-top3", LIST, sampling=SamplingParams(top_n_tokens=3),
         text=TextOptions(want_tokens=True, want_logprobs=True)),
    Case("seeded-temperature", STORY, sampling=SamplingParams(temperature=0.8, **SEEDED),
         text=TextOptions(want_tokens=True, want_logprobs=True)),
    Case("seeded-top-k", STORY, sampling=SamplingParams(top_k=5, **SEEDED),
         text=TextOptions(want_tokens=True, want_logprobs=True)),
    Case("seeded-top-p", STORY, sampling=SamplingParams(temperature=0.9, top_p=0.8, top_n_tokens=2, **SEEDED),
         text=TextOptions(want_tokens=True, want_logprobs=True)),
    Case("seeded-typical-p", QUESTION, sampling=SamplingParams(typical_p=0.7, **SEEDED), chat=True),
    Case("seeded-min-p", QUESTION, sampling=SamplingParams(min_p=0.1, **SEEDED), chat=True),
    Case("seeded-all-warpers", LIST, sampling=SamplingParams(temperature=0.7, top_k=40, top_p=0.9, typical_p=0.95,
                                                           min_p=0.02, **SEEDED)),
    Case("greedy-penalties", LIST, sampling=SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5,
                                                         presence_penalty=0.4),
         stopping=StoppingParams(max_new_tokens=20), text=TextOptions(want_tokens=True, want_logprobs=True)),
    Case("seeded-penalties", STORY, sampling=SamplingParams(temperature=1.1, repetition_penalty=1.2,
                                                          frequency_penalty=-0.3, **SEEDED)),
    Case("min-new-tokens-ignore-eos", QUESTION, stopping=StoppingParams(max_new_tokens=10, min_new_tokens=6,
                                                                        ignore_eos=True)),
    Case("stop-string", STORY, stopping=StoppingParams(max_new_tokens=24), text=TextOptions(stop_sequences=(" She",))),
    Case("stop-string-kept", LIST, stopping=StoppingParams(max_new_tokens=24),
         text=TextOptions(stop_sequences=(":",), include_stop_sequence=True)),
    Case("n2-seeded", STORY, sampling=SamplingParams(temperature=0.9, **SEEDED), n=2,
         stopping=StoppingParams(max_new_tokens=10)),
    Case("best-of-2", QUESTION, sampling=SamplingParams(temperature=1.0, **SEEDED), best_of=2,
         stopping=StoppingParams(max_new_tokens=8), chat=True),
    Case("prompt-logprobs", QUESTION, sampling=SamplingParams(prompt_logprobs=True),
         stopping=StoppingParams(max_new_tokens=4), prompt_logprobs=True, chat=True),
]
# Sent one after the other: the second finds the first's full blocks in the prefix cache.
PREFIX_CASES = [
    Case("prefix-first", LONG + " First,", stopping=StoppingParams(max_new_tokens=6)),
    Case("prefix-second", LONG + " Second,", stopping=StoppingParams(max_new_tokens=6)),
]
# A small pool and small prefill chunks: long prompts are chunked, and the running batch outgrows
# the pool, so sequences are preempted and recomputed.
SMALL_POOL_CASES = [
    Case(f"pressure-{i}", f"Variation {i}. {LONG}",
         sampling=SamplingParams(temperature=0.8, **SEEDED) if i % 2 else SamplingParams(),
         stopping=StoppingParams(max_new_tokens=40, ignore_eos=True)) for i in range(6)
]


def _hex(x: float | None) -> str | None:
    return None if x is None else float(x).hex()


def _tokens(tokens: list[TokenInfo]) -> list[dict[str, Any]]:
    return [{"id": t.id, "text": t.text, "logprob": _hex(t.logprob), "special": t.special,
             "top": [[a.id, _hex(a.logprob)] for a in t.top_tokens]} for t in tokens]


async def _run_case(client: InProcessEngine, tok: Tokenizer, case: Case) -> dict[str, Any]:
    prompt = tok.render_chat([{"role": "user", "content": case.prompt}]) if case.chat else case.prompt
    ids = tuple(tok.encode(prompt, add_special_tokens=not case.chat))
    request = EngineRequest(case.name, ids, case.sampling, case.stopping, n=max(case.n, case.best_of))
    text = replace(case.text, min_new_tokens=case.stopping.min_new_tokens)
    plan = GenerationPlan(request, n=case.n, text=text, prompt_logprobs=case.prompt_logprobs)
    result = await collect_completions(generate_chunks(client, tok, plan), plan)
    return {
        "prompt_tokens": len(ids),
        "cached_prompt_tokens": result.cached_prompt_tokens,
        "generated_tokens": result.generated_tokens,
        "prompt_logprobs": _tokens(result.prompt_tokens) if result.prompt_tokens is not None else None,
        "completions": [{
            "index": c.index, "text": c.text, "finish_reason": c.finish_reason.value if c.finish_reason else None,
            "generated_tokens": c.generated_tokens, "cumulative_logprob": _hex(c.cumulative_logprob),
            "seed": c.seed, "tokens": _tokens(c.tokens),
        } for c in result.completions],
    }


async def _run_scenario(engine: LLMEngine, tok: Tokenizer, cases: list[Case], together: bool) -> dict[str, Any]:
    client = InProcessEngine(engine)
    if together:
        results = await asyncio.gather(*(_run_case(client, tok, c) for c in cases))
    else:
        results = [await _run_case(client, tok, c) for c in cases]
    return dict(zip((c.name for c in cases), results, strict=True))


def _engine(model_dir: Path, **overrides: Any) -> LLMEngine:
    config = EngineConfig(model_id=str(model_dir), device="cpu", dtype="float32", num_threads=2,
                          cuda_graphs=(), **overrides)
    return LLMEngine(config)


def _stats(engine: LLMEngine) -> dict[str, int]:
    s = engine.stats()
    assert s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_blocks, s
    return {"preemptions": s.num_preemptions, "prefix_cache_hits": s.prefix_cache_hits,
            "prefill_chunks": s.num_prefill_chunks}


def record(model_dir: Path) -> dict[str, Any]:
    tok = Tokenizer.from_model_dir(model_dir)
    out: dict[str, Any] = {}
    engine = _engine(model_dir, max_batch_total_tokens=8192)
    out["batch"] = asyncio.run(_run_scenario(engine, tok, BATCH_CASES, together=True))
    out["prefix"] = asyncio.run(_run_scenario(engine, tok, PREFIX_CASES, together=False))
    out["batch_prefix_stats"] = _stats(engine)
    del engine
    engine = _engine(model_dir, max_batch_total_tokens=640, max_batch_prefill_tokens=64)
    out["small_pool"] = asyncio.run(_run_scenario(engine, tok, SMALL_POOL_CASES, together=True))
    out["small_pool_stats"] = stats = _stats(engine)
    assert stats["preemptions"] > 0 and stats["prefill_chunks"] > len(SMALL_POOL_CASES), stats
    assert out["prefix"]["prefix-second"]["cached_prompt_tokens"] > 0
    return out


def tiny_llama_dir(default_dir: Path, path: Path) -> Path:
    """A random-weight 2-layer Llama with SmolLM2's vocabulary and tokenizer files."""
    return save_tiny_llama_with_vocab_of(default_dir, path, max_position_embeddings=2048)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with the committed files instead of writing")
    parser.add_argument("--models", default="smollm2,tiny-llama", help="comma-separated: smollm2, tiny-llama")
    args = parser.parse_args(argv)
    from loom.model_loader import resolve_model_dir

    default_dir = resolve_model_dir(None)
    differing = []
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {"smollm2": lambda: default_dir, "tiny-llama": lambda: tiny_llama_dir(default_dir, Path(tmp))}
        for name in args.models.split(","):
            text = json.dumps(record(dirs[name]()), indent=1, ensure_ascii=False, sort_keys=True) + "\n"
            path = GOLDEN_DIR / f"{name}.json"
            if args.check:
                same = path.exists() and path.read_text() == text
                print(f"{name}: {'same bytes' if same else 'DIFFERENT'} ({path.relative_to(ROOT)})")
                if not same:
                    differing.append(name)
                    (Path(tmp) / f"{name}.new.json").write_text(text)
                    new = Path(tempfile.gettempdir()) / f"golden-{name}.new.json"
                    shutil.copy(Path(tmp) / f"{name}.new.json", new)
                    print(f"  new output kept in {new}")
            else:
                GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
                print(f"{name}: written to {path.relative_to(ROOT)}")
    return 1 if differing else 0


if __name__ == "__main__":
    raise SystemExit(main())
