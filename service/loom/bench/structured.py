"""S1, structured output (../shared/bench/WORKLOADS.md): compile times and decoding cost of grammars.

- Compile time, cold and cached (p50 / p99): each of the 8 schemas in ``variants`` renamed
  copies (so no cache helps), one compile at a time on a :class:`GrammarCompilerPool` with the
  model's vocabulary; then the same texts again, from the cache. TGI #2902's case, a schema of
  10 optional properties, is reported on its own.
- Mask cost per step: filling the bitmask rows of 64 matchers and applying them to [64, V] logits
  on the engine's device.
- Throughput: 64 chat requests, request i asking for schema i % 8 (for its own example, so no
  two requests are alike; ``--s1-shared-prompts``: the 8 of a schema identical), all submitted at once with
  their grammars (compiled beforehand: steady state), greedy, EOS honoured; then the same
  requests without a grammar, each generating exactly as many tokens as its constrained twin
  did (EOS ignored), so the two runs do the same arithmetic and differ only by the grammar's
  work. Output tok/s of both, their ratio, and the share of constrained outputs that end by EOS
  and parse and validate (jsonschema) against their schema.
"""

from __future__ import annotations

import asyncio
import copy
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loom.config import EngineConfig
from loom.engine.types import EngineRequest, FinishReason, SamplingParams, StoppingParams
from loom.structured.spec import GrammarSpec

SCHEMAS: dict[str, dict[str, Any]] = {
    # TGI #2902: many optional properties made outlines' compile slow (plain strings, as there)
    "optional10": {"type": "object", "properties": {
        name: {"type": "string"} for name in (
            "make", "model", "color", "engine", "fuel", "gearbox", "body", "drive", "origin", "owner")}},
    "nested_arrays": {"type": "object", "properties": {
        "matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}, "maxItems": 3},
                   "minItems": 1, "maxItems": 3},
        "labels": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
        "required": ["matrix", "labels"]},
    "enums": {"type": "object", "properties": {
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "language": {"enum": ["en", "fr", "de", "es"]},
        "confidence": {"enum": ["low", "medium", "high"]}},
        "required": ["sentiment", "language", "confidence"]},
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 32}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "format": "email"}}, "required": ["name", "age"]},
    "address": {"type": "object", "properties": {
        "street": {"type": "string", "maxLength": 40}, "city": {"type": "string", "maxLength": 24},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "geo": {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                                 "lon": {"type": "number", "minimum": -180, "maximum": 180}},
                "required": ["lat", "lon"]}}, "required": ["street", "city", "zip"]},
    "event": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40}, "date": {"type": "string", "format": "date"},
        "attendees": {"type": "integer", "minimum": 1, "maximum": 1000}, "online": {"type": "boolean"}},
        "required": ["title", "date", "online"]},
    "product": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "price": {"type": "number", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
        "stock": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}]}},
        "required": ["sku", "price"]},
    "recipe": {"type": "object", "properties": {
        "dish": {"type": "string", "maxLength": 32},
        "steps": {"type": "array", "items": {"type": "object", "properties": {
            "order": {"type": "integer", "minimum": 1, "maximum": 20}, "text": {"type": "string", "maxLength": 48}},
            "required": ["order", "text"]}, "minItems": 1, "maxItems": 3},
        "vegetarian": {"type": "boolean"}}, "required": ["dish", "steps", "vegetarian"]},
}
PROMPTS = {
    "optional10": "Describe a car you like as a JSON object.",
    "nested_arrays": "Give a small matrix of digits and some labels as JSON.",
    "enums": "Classify the text 'Ce film est magnifique' as JSON: sentiment, language, confidence.",
    "person": "Invent a person and give their name, age and email as JSON.",
    "address": "Give the address of a famous museum as JSON.",
    "event": "Describe a concert as JSON.",
    "product": "Describe a product in a shop as JSON.",
    "recipe": "Give a short recipe as JSON.",
}


def _percentile(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] if s else 0.0


def _summary(seconds: Sequence[float]) -> dict[str, float]:
    return {"p50_ms": 1e3 * _percentile(seconds, 0.5), "p99_ms": 1e3 * _percentile(seconds, 0.99),
            "mean_ms": 1e3 * statistics.fmean(seconds) if seconds else 0.0, "count": len(seconds)}


def _renamed(schema: dict[str, Any], suffix: str) -> dict[str, Any]:
    """``schema`` with every property name suffixed: the same shape, a different text."""
    out = copy.deepcopy(schema)
    stack = [out]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("properties"), dict):
                node["properties"] = {f"{k}_{suffix}": v for k, v in node["properties"].items()}
                if isinstance(node.get("required"), list):
                    node["required"] = [f"{k}_{suffix}" for k in node["required"]]
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return out


def measure_compiles(model_dir: Path, vocab_size: int, eos: tuple[int, ...], variants: int,
                     device: torch.device) -> dict[str, Any]:
    """Cold and cached compile times, and the per-step cost of 64 rows' masks."""
    from loom.sample.processors import TokenBitmask
    from loom.structured.compiler_pool import GrammarCompilerPool
    from loom.structured.vocabulary import vocabulary_from_model_dir

    pool = GrammarCompilerPool(lambda: vocabulary_from_model_dir(model_dir, vocab_size, eos), workers=1)
    pool.compile(GrammarSpec("regex", "warm")).result()  # the one-time vocabulary description
    cold: dict[str, list[float]] = {name: [] for name in SCHEMAS}
    specs: list[GrammarSpec] = []
    compiled = []
    for v in range(variants):
        for name, schema in SCHEMAS.items():
            spec = GrammarSpec("json_schema", json.dumps(_renamed(schema, f"v{v}")))
            started = time.perf_counter()
            compiled.append(pool.compile(spec).result())
            cold[name].append(time.perf_counter() - started)
            specs.append(spec)
    cached = []
    for spec in specs:
        started = time.perf_counter()
        pool.compile(spec).result()
        cached.append(time.perf_counter() - started)
    import xgrammar as xg

    rows = 64
    matchers = [xg.GrammarMatcher(compiled[i % len(compiled)]) for i in range(rows)]
    words = -(-vocab_size // 32)
    bitmask = torch.empty(rows, words, dtype=torch.int32)
    logits = torch.randn(rows, vocab_size, device=device)
    rows_t, row_list = torch.arange(rows, device=device), list(range(rows))
    fills, applies = [], []
    for _ in range(20):
        started = time.perf_counter()
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)
        fills.append(time.perf_counter() - started)
        on_device = bitmask.to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        TokenBitmask(on_device, rows_t, row_list)(logits)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        applies.append(time.perf_counter() - started)
    every = [t for ts in cold.values() for t in ts]
    return {
        "variants_per_schema": variants,
        "cold": _summary(every),
        "cold_by_schema_p50_ms": {name: 1e3 * _percentile(ts, 0.5) for name, ts in cold.items()},
        "optional10_cold": _summary(cold["optional10"]),
        "cached": {"p50_us": 1e6 * _percentile(cached, 0.5), "p99_us": 1e6 * _percentile(cached, 0.99)},
        "mask_64_rows": {"fill_us_median": 1e6 * statistics.median(fills[2:]),
                         "apply_us_median": 1e6 * statistics.median(applies[2:]), "device": str(device)},
    }


@dataclass
class _Result:
    token_ids: list[int]
    finish: FinishReason | None


async def _run_all(client: Any, requests: list[EngineRequest]) -> tuple[float, list[_Result]]:
    async def one(req: EngineRequest) -> _Result:
        ids: list[int] = []
        finish = None
        async for out in client.generate(req):
            if out.error:
                raise RuntimeError(f"{req.request_id} failed in the engine: {out.error}")
            ids += out.token_ids
            finish = out.finish_reason or finish
        return _Result(ids, finish)

    started = time.perf_counter()
    results = await asyncio.gather(*(one(r) for r in requests))
    return time.perf_counter() - started, list(results)


async def _throughput(cfg: EngineConfig, prompts: list[list[int]], names: list[str], new_tokens: int,
                      repeats: int) -> tuple[list[dict[str, Any]], list[_Result]]:
    from loom.engine.core_process import AsyncEngineClient

    client = AsyncEngineClient(cfg)
    await client.start()
    runs: list[dict[str, Any]] = []
    constrained: list[_Result] = []
    try:
        def spec(name: str) -> GrammarSpec:
            return GrammarSpec("json_schema", json.dumps(SCHEMAS[name]), "parameters.constraint.json_schema")

        # compile every grammar, and warm the kernels, before timing
        await _run_all(client, [EngineRequest(f"warm-{n}", tuple(prompts[i]), SamplingParams(constraint=spec(n)),
                                              StoppingParams(max_new_tokens=4))
                                for i, n in enumerate(dict.fromkeys(names))])
        # One untimed pair at full size first: the batch's shapes (masks of 64 rows, the bitmask
        # kernel's first launch, graphs of every batch size the tail passes through) are warm
        # for both arms (on the H200 the first timed pair ran at 0.59x, the third at 0.99x).
        for r in range(-1, repeats):
            with_grammar = [EngineRequest(f"g{r}-{i}", tuple(p), SamplingParams(constraint=spec(n)),
                                          StoppingParams(max_new_tokens=new_tokens))
                            for i, (p, n) in enumerate(zip(prompts, names, strict=True))]
            g_s, constrained = await _run_all(client, with_grammar)
            counts = [len(res.token_ids) for res in constrained]
            without = [EngineRequest(f"u{r}-{i}", tuple(p), SamplingParams(),
                                     StoppingParams(max_new_tokens=c, ignore_eos=True))
                       for i, (p, c) in enumerate(zip(prompts, counts, strict=True))]
            u_s, _ = await _run_all(client, without)
            tokens = sum(counts)
            if r < 0:
                continue
            runs.append({"out_tokens": tokens, "with_grammar_s": g_s, "without_s": u_s,
                         "with_grammar_out_tok_s": tokens / g_s, "without_out_tok_s": tokens / u_s,
                         "ratio": (tokens / g_s) / (tokens / u_s)})
    finally:
        await client.shutdown()
    return runs, constrained


def _validity(tokenizer: Any, names: list[str], results: list[_Result]) -> dict[str, Any]:
    try:
        import jsonschema
    except ImportError:  # a test extra: report what can be checked without it
        jsonschema = None
    eos = valid = 0
    failures: list[str] = []
    for name, res in zip(names, results, strict=True):
        if res.finish is not FinishReason.EOS_TOKEN:
            continue
        eos += 1
        text = tokenizer.decode(res.token_ids, skip_special_tokens=True)
        try:
            value = json.loads(text)
            if jsonschema is not None:
                jsonschema.validate(value, SCHEMAS[name])
            valid += 1
        except Exception as exc:
            failures.append(f"{name}: {type(exc).__name__}: {str(exc)[:80]} in {text[:80]!r}")
    return {"requests": len(results), "ended_by_eos": eos, "valid_of_eos": valid,
            "valid_share_of_eos": valid / eos if eos else None, "checked_with_jsonschema": jsonschema is not None,
            "failures": failures[:5]}


def request_prompt(name: str, i: int, shared: bool) -> str:
    """Request ``i``'s user message for schema ``name``. Unless ``shared``, each request asks for
    its own example, so no two greedy outputs (and no two grammar matchers) move in lockstep, as
    in real traffic; shared, the requests of one schema are identical (S1 before 2026-12-03)."""
    return PROMPTS[name] if shared else f"{PROMPTS[name]} Example {i // len(SCHEMAS) + 1}."


def run_s1(cfg: EngineConfig, requests: int, new_tokens: int, variants: int, repeats: int,
           shared_prompts: bool = False) -> dict[str, Any]:
    from loom.frontend.tokenizer import Tokenizer
    from loom.model_loader import eos_token_ids, load_hf_config, model_dims, resolve_model_dir
    from loom.worker.worker import resolve_device

    model_dir = Path(resolve_model_dir(cfg.model_id))
    tokenizer = Tokenizer.from_model_dir(model_dir)
    names = [list(SCHEMAS)[i % len(SCHEMAS)] for i in range(requests)]
    prompts = [tokenizer.encode_chat([{"role": "system", "content": "Answer with JSON only."},
                                      {"role": "user", "content": request_prompt(n, i, shared_prompts)}])
               for i, n in enumerate(names)]
    vocab = model_dims(load_hf_config(model_dir)).vocab_size
    compiles = measure_compiles(model_dir, vocab, eos_token_ids(model_dir), variants, resolve_device(cfg.device))
    runs, constrained = asyncio.run(_throughput(cfg, prompts, names, new_tokens, repeats))
    return {
        "description": f"{requests} requests over {len(SCHEMAS)} JSON schemas, greedy, up to {new_tokens} new tokens; "
                       "the same requests without a grammar generate as many tokens each; "
                       + ("the requests of one schema share a prompt" if shared_prompts else
                          "each request its own prompt"),
        "shared_prompts": shared_prompts,
        "compile": compiles,
        "throughput": {"runs": runs, "ratio_mean": statistics.fmean(r["ratio"] for r in runs),
                       "ratio_median": statistics.median(r["ratio"] for r in runs),
                       # all pairs together: total time without over total time with grammars
                       "ratio_total": sum(r["without_s"] for r in runs) / sum(r["with_grammar_s"] for r in runs),
                       "with_grammar_out_tok_s_mean": statistics.fmean(r["with_grammar_out_tok_s"] for r in runs),
                       "without_out_tok_s_mean": statistics.fmean(r["without_out_tok_s"] for r in runs)},
        "validity": _validity(tokenizer, names, constrained),
    }
