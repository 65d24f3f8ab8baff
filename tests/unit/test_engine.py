"""The engine end to end on CPU: greedy parity with transformers, batch invariance, preemption."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.tiny_models import load_hf_reference

from loom.config import EngineConfig
from loom.engine.llm_engine import LLMEngine
from loom.engine.types import EngineRequest, FinishReason, SamplingParams, StoppingParams


def hf_greedy(model: torch.nn.Module, prompt: list[int], new: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),  # type: ignore[operator]
                         max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def req(rid: str, prompt: list[int], new: int, **sampling: object) -> EngineRequest:
    return EngineRequest(rid, tuple(prompt), SamplingParams(**sampling),  # type: ignore[arg-type]
                         StoppingParams(max_new_tokens=new, ignore_eos=True))


def run_all(engine: LLMEngine, requests: list[EngineRequest],
            arrivals: dict[str, int] | None = None) -> dict[str, list[int]]:
    """Run to completion; ``arrivals[rid]`` is the step at which a request is submitted."""
    arrivals = arrivals or {}
    pending = sorted(requests, key=lambda r: arrivals.get(r.request_id, 0))
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    step = 0
    while pending or engine.has_unfinished():
        while pending and arrivals.get(pending[0].request_id, 0) <= step:
            engine.add_request(pending.pop(0))
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
        step += 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "KV blocks leaked"
    return tokens


def prompts(n: int, vocab: int, seed: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "llama3-rope"])
def test_greedy_equals_transformers_in_a_mixed_batch(arch: str, tiny_model_dir: Callable[[str], Path]) -> None:
    path = tiny_model_dir(arch)
    engine = LLMEngine(EngineConfig(model_id=str(path), block_size=4, max_batch_total_tokens=2048))
    ps = prompts(5, 320, seed=1)
    news = [12, 5, 20, 1, 9]
    got = run_all(engine, [req(f"r{i}", p, n) for i, (p, n) in enumerate(zip(ps, news, strict=True))])
    hf = load_hf_reference(path)
    for i, (p, n) in enumerate(zip(ps, news, strict=True)):
        assert got[f"r{i}"] == hf_greedy(hf, p, n), f"{arch} request {i}"


def test_same_tokens_alone_and_in_a_batch_of_32_joining_and_leaving(make_engine: Callable[..., LLMEngine]) -> None:
    rng = random.Random(7)
    ps = prompts(32, 320, seed=2, lo=2, hi=60)
    reqs = [req(f"r{i}", p, rng.randint(1, 40)) for i, p in enumerate(ps)]
    arrivals = {r.request_id: rng.randint(0, 30) for r in reqs}
    engine = make_engine(max_batch_total_tokens=4096, max_batch_prefill_tokens=128)
    batched = run_all(engine, reqs, arrivals)
    alone_engine = make_engine(max_batch_total_tokens=4096)
    for r in reqs:
        assert run_all(alone_engine, [r])[r.request_id] == batched[r.request_id], r.request_id
    assert engine.num_steps < sum(r.stopping.max_new_tokens for r in reqs)  # they really shared steps


def test_forced_preemption_gives_the_same_tokens(make_engine: Callable[..., LLMEngine]) -> None:
    ps = prompts(12, 320, seed=3, lo=10, hi=30)
    reqs = [req(f"r{i}", p, 40) for i, p in enumerate(ps)]
    roomy = run_all(make_engine(max_batch_total_tokens=4096), reqs)
    # 32 blocks of 4 = 128 tokens: far too few for 12 x ~60 tokens, but >= one sequence's max
    tight_engine = make_engine(max_batch_total_tokens=128, max_total_tokens=128)
    tight = run_all(tight_engine, reqs)
    assert tight_engine.scheduler.num_preemptions > 0
    assert tight == roomy


def test_seeded_sampling_survives_preemption_and_batching(make_engine: Callable[..., LLMEngine]) -> None:
    ps = prompts(10, 320, seed=4, lo=10, hi=30)
    reqs = [req(f"r{i}", p, 30, do_sample=True, seed=100 + i, temperature=1.5, top_k=50) for i, p in enumerate(ps)]
    roomy = run_all(make_engine(max_batch_total_tokens=4096), reqs)
    tight_engine = make_engine(max_batch_total_tokens=128, max_total_tokens=128)
    assert run_all(tight_engine, reqs) == roomy
    assert tight_engine.scheduler.num_preemptions > 0
    alone = run_all(make_engine(max_batch_total_tokens=4096), [reqs[3]])
    assert alone["r3"] == roomy["r3"]


def test_n_completions_share_the_prompt_blocks(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine(max_batch_total_tokens=512)
    prompt = prompts(1, 320, seed=5, lo=10, hi=10)[0]
    r = EngineRequest("n3", tuple(prompt), SamplingParams(do_sample=True, seed=9),
                      StoppingParams(max_new_tokens=6, ignore_eos=True), n=3)
    engine.add_request(r)
    outs = engine.step()  # the prefill: one forward for the prompt, three first tokens
    assert sorted(o.index for o in outs) == [0, 1, 2]
    seqs = engine.requests["n3"]
    assert seqs[0].block_table[:2] == seqs[1].block_table[:2] == seqs[2].block_table[:2]
    rc = engine.block_manager.allocator.refcounts
    assert rc[seqs[0].block_table[0]] == 3
    assert engine.block_manager.num_blocks - engine.block_manager.num_free_blocks == 3  # 10 tokens / 4
    tokens: dict[int, list[int]] = {o.index: list(o.token_ids) for o in outs}
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.index].extend(o.token_ids)
    assert all(len(t) == 6 for t in tokens.values())
    assert len({tuple(t) for t in tokens.values()}) > 1  # different seeds per completion
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_eos_and_stop_tokens_finish_requests(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine(max_batch_total_tokens=512)
    prompt = prompts(1, 320, seed=6)[0]
    free_run = run_all(engine, [req("a", prompt, 10)])["a"]
    stop_at = free_run[3]
    engine.add_request(EngineRequest("b", tuple(prompt), SamplingParams(),
                                     StoppingParams(max_new_tokens=10, stop_token_ids=(stop_at,))))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [t for o in outs for t in o.token_ids] == free_run[: free_run.index(stop_at) + 1]
    assert outs[-1].finish_reason is FinishReason.STOP_SEQUENCE


def test_abort_frees_blocks(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine(max_batch_total_tokens=512)
    engine.add_request(req("a", prompts(1, 320, seed=8)[0], 50))
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    engine.abort("a")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished()


@pytest.mark.slow
@pytest.mark.parametrize("quantize", ["auto", "none"])
def test_smollm2_greedy_equals_transformers(default_model_dir: Path, quantize: str) -> None:
    """Dense weights, and (auto, on the CPU) the GGUF file's own blocks: the same tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loom_plugins.quant.gguf import kernel_available

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    texts = ["The capital of France is", "def fibonacci(n):",
             "Write a haiku about the sea. " * 6, "1, 2, 3, 4,"]
    ps = [tok(t)["input_ids"] for t in texts]
    engine = LLMEngine(EngineConfig(num_threads=2, max_batch_total_tokens=8192, quantize=quantize))
    expected = ("quantizer:gguf",) if quantize == "auto" and kernel_available() else ()
    assert engine.info.plugins == expected
    got = run_all(engine, [req(f"r{i}", p, 16) for i, p in enumerate(ps)])
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == hf_greedy(hf, p, 16), texts[i]


def test_step_trace_has_a_line_per_step(make_engine: Callable[..., LLMEngine], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    trace = tmp_path / "steps.jsonl"
    monkeypatch.setenv("LOOM_STEP_TRACE", str(trace))
    engine = make_engine(warmup=False, max_batch_prefill_tokens=8)
    run_all(engine, [req("a", list(range(3, 13)), 3), req("b", [5, 6], 2)], arrivals={"b": 2})
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    # a 10-token prompt in chunks of 8, then "b" joins at the third step beside "a"'s first decode
    assert [(x["prefill_tokens"], x["decode_rows"], x["running"]) for x in lines] == [
        (8, 0, 1), (2, 0, 1), (2, 1, 2), (0, 2, 2)]
    assert all(not x["overlapped"] for x in lines)  # CPU: synchronous steps


def test_block_tables_are_zero_padded_rows() -> None:
    from loom.worker.model_runner import _block_tables

    assert _block_tables([[4, 9], [], [7, 1, 8]], 4).tolist() == [4, 9, 0, 0, 0, 0, 0, 0, 7, 1, 8, 0]


def test_engine_seed_fixes_the_seeds_drawn_for_unseeded_requests(make_engine: Any) -> None:
    """--seed: the seeds the engine draws (and reports) for sampled requests without one."""
    from loom.engine.types import EngineRequest, SamplingParams, StoppingParams

    def drawn(engine: Any) -> list[int | None]:
        seeds = []
        for i in range(3):
            engine.add_request(EngineRequest(f"r{i}", (5, 6, 7), SamplingParams(do_sample=True),
                                             StoppingParams(max_new_tokens=1)))
        while engine.has_unfinished():
            seeds += [o.seed for o in engine.step() if o.finished]
        return seeds

    first, again, other = (drawn(make_engine(seed=s)) for s in (7, 7, 8))
    assert len(first) == 3 and None not in first
    assert first == again and first != other


def test_the_cpu_pool_is_sized_from_the_limits_and_logged(make_engine: Callable[..., LLMEngine],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from loom.engine import llm_engine
    from loom.engine.kv_pool_sizing import kv_bytes_per_token

    lines: list[tuple[str, dict[str, object]]] = []

    class Recorder:
        def info(self, event: str, **fields: object) -> None:
            lines.append((event, fields))

        warning = debug = info

    monkeypatch.setattr(llm_engine, "log", Recorder())
    engine = make_engine(max_total_tokens=128)
    model = engine.worker.info
    per_token = kv_bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, 4)
    assert engine.kv_pool is not None and engine.kv_pool.bytes_per_token == per_token
    assert engine.info.max_batch_total_tokens == engine.kv_pool.tokens == 4 * 128  # 4 sequences at full length
    assert engine.info.num_blocks == engine.block_manager.num_blocks == 128  # 4-token blocks
    sized = [fields for event, fields in lines if event == "kv cache sized"]
    assert len(sized) == 1
    assert sized[0]["max_batch_total_tokens"] == 512 and sized[0]["kv_blocks"] == 128
    assert sized[0]["reason"].startswith("4 sequences of max_total_tokens 128")  # type: ignore[union-attr]
    assert sized[0]["kv_cache_mib"] == round(512 * per_token / (1 << 20), 1)
    one = make_engine(max_total_tokens=128, max_batch_size=1)
    assert one.info.max_batch_total_tokens == 128
    explicit = make_engine(max_total_tokens=128, max_batch_total_tokens=1024)
    assert explicit.info.max_batch_total_tokens == 1024 and explicit.kv_pool is not None
    assert explicit.kv_pool.reason == "--max-batch-total-tokens"
