"""C3 / W5(a): speculative decoding on copy-heavy chat requests, against no speculation, in one run.

16 requests on the real SmolLM2 (greedy, its chat template): 8 passages shipped with Loom
(``data/c3_passages.txt``, 150-230 tokens each), each asked for once word for word and once
with a summary sentence appended; ``max_new_tokens`` 256, ending at EOS. Each setting is run
one request at a time (batch 1) and all 16 at once, by an in-process engine (the step loop
alone: what speculation changes), without speculation and with ``--speculate K``; the outputs of
the two must be identical.
"""

from __future__ import annotations

import gc
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from loom.config import EngineConfig
from loom.engine.types import EngineRequest, SamplingParams, StoppingParams
from loom.process_tuning import startup_objects_frozen

_PASSAGES = Path(__file__).parent / "data" / "c3_passages.txt"
_ASKS = ("Repeat the following passage exactly, word for word, and nothing else.\n\n{passage}",
         "Repeat the following passage word for word, then add one sentence that summarises it.\n\n{passage}")


def c3_prompts(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    passages = [p.strip() for p in _PASSAGES.read_text().split("\n\n") if p.strip()]
    prompts = []
    for ask in _ASKS:
        for passage in passages:
            text = tok.apply_chat_template([{"role": "user", "content": ask.format(passage=passage)}],
                                           add_generation_prompt=True, tokenize=False)
            prompts.append(list(tok(str(text), add_special_tokens=False)["input_ids"]))
    return prompts


def _run(config: EngineConfig, prompts: list[list[int]], batch: int, new: int) -> dict[str, Any]:
    from loom.engine.llm_engine import LLMEngine

    gc.collect()  # the previous run's engine, before this one sizes its pool
    engine = LLMEngine(config)
    outputs: dict[str, list[int]] = {}
    # frozen, as in the server: a full collection of the start-up objects in the timed loop took
    # 0.2-0.3 s, enough to move a 1.6 s speculating run's ratio from 2.15x to 1.8x
    with startup_objects_frozen():
        started = time.perf_counter()
        for first in range(0, len(prompts), batch):
            for i in range(first, min(len(prompts), first + batch)):
                engine.add_request(EngineRequest(f"c3-{i}", tuple(prompts[i]), SamplingParams(),
                                                 StoppingParams(max_new_tokens=new)))
            while engine.has_unfinished():
                for out in engine.step():
                    outputs.setdefault(out.request_id, []).extend(out.token_ids)
        seconds = time.perf_counter() - started
    tokens = sum(len(t) for t in outputs.values())
    entry: dict[str, Any] = {"s": seconds, "out_tokens": tokens, "out_tok_s": tokens / seconds,
                             "steps": engine.num_steps}
    if engine.speculator is not None:
        c = engine.speculator.counters
        entry.update(draft_tokens=c.draft_tokens, accepted_tokens=c.accepted_tokens,
                     verifications=c.verifications,
                     acceptance=c.accepted_tokens / c.draft_tokens if c.draft_tokens else 0.0,
                     # tokens a sequence gains in a verifying step: accepted drafts + the model's own
                     tokens_per_verification=(c.accepted_tokens + c.verifications) / c.verifications
                     if c.verifications else 0.0)
    entry["_outputs"] = [outputs[f"c3-{i}"] for i in range(len(prompts))]
    return entry


def run_c3(base: EngineConfig, k: int, batches: tuple[int, ...] = (1, 16), new: int = 256,
           quick: bool = False) -> dict[str, Any]:
    """Plain and speculating runs for each batch size; outputs compared token for token."""
    from loom.model_loader import resolve_model_dir

    prompts = c3_prompts(resolve_model_dir(base.model_id))
    if quick:
        prompts, new = prompts[:2], 16
    result: dict[str, Any] = {
        "description": f"{len(prompts)} copy-heavy chat requests (SmolLM2, greedy), max_new_tokens {new}; "
                       f"--speculate {k} ngram against none",
        "prompt_tokens": [len(p) for p in prompts],
    }
    for batch in batches:
        plain = _run(replace(base, speculate=0), prompts, batch, new)
        spec = _run(replace(base, speculate=k), prompts, batch, new)
        same = plain.pop("_outputs") == spec.pop("_outputs")
        result[f"batch_{batch}"] = {"plain": plain, "speculate": spec, "identical_outputs": same,
                                    "speedup": spec["out_tok_s"] / plain["out_tok_s"]}
    return result
