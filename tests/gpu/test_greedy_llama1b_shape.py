"""Greedy generation of the engine (``paged`` backend, CUDA-graph decode) against transformers, on
a Llama-3.2-1B-shaped model with random weights (hidden 2048, 16 layers, 32 heads, 8 KV heads,
intermediate 8192, vocab 128256, tied embeddings; all 16 layers, saved as a 2.5 GB bf16
safetensors checkpoint in a temporary directory).

The engine runs in bf16. The reference is transformers on the same bf16 weights computed in
float32, so it carries no rounding of its own worth speaking of. A random model's logits are
nearly flat over 128k tokens: the top two are typically only ~0.2 standard deviations apart,
so bf16 rounding (ours) can legitimately flip a near-tie. Hence three checks, per prompt:

1. exact match with transformers' own greedy continuation up to the first step where its top-2
   logit margin falls under ``MARGIN`` (after a flip the continuations are different texts);
2. teacher-forced on the engine's tokens, every chosen token is within ``TIE_TOL`` of
   transformers' best logit at that position (an argmax up to a near-tie), at all positions;
3. the engine's reported log-probability of each chosen token is within ``LOGPROB_TOL`` of
   transformers' for that token.

Seen on an H200 (2026-11-29, 6 prompts x 24 tokens, CUDA-graph decode): 13 clear-margin tokens,
all equal; teacher-forced argmax agreement 131/144, largest gap of a chosen token 0.070; largest
log-probability difference 0.099. The tolerances are those figures with headroom; a wrong
kernel gives gaps and log-probability errors of order 1.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MARGIN = 0.1  # logits (whose std is ~0.9 for this init): a clear argmax vs a near-tie
TIE_TOL = 0.15  # how far below the best logit a chosen near-tie may be
LOGPROB_TOL = 0.2
NEW_TOKENS = 24
PROMPT_LENS = (5, 17, 64, 130, 300, 611)


def _build_checkpoint(path: Path) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape: dict[str, Any] = dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=2048,
        tie_word_embeddings=True, initializer_range=0.02, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):  # initialised on the GPU, directly in bf16
        model = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    return model


def test_greedy_equals_transformers(tmp_path: Path) -> None:
    import loom_plugins.attention
    import loom_plugins.models
    from loom.config import EngineConfig
    from loom.engine.llm_engine import LLMEngine
    from loom.engine.types import EngineRequest, SamplingParams, StoppingParams
    from loom.plugin_api import PluginRegistry
    from loom.worker.cuda_graphs import maybe_capture_cuda_graphs

    # The built-in plugins directly: where loom is not pip-installed there are no entry points.
    registry = PluginRegistry()
    registry.register(loom_plugins.models, "loom-models", "loom-server")
    registry.register(loom_plugins.attention, "loom-attention", "loom-server")
    hf = _build_checkpoint(tmp_path)
    engine = LLMEngine(EngineConfig(model_id=str(tmp_path), device="cuda", dtype="bfloat16",
                                    attention_backend="paged", max_batch_total_tokens=32768,
                                    max_total_tokens=1024, cuda_graphs=(1, 2, 4, 8)), registry)
    runner = engine.runner
    assert runner is not None
    if runner.cuda_graphs is None:  # the engine may not wire graphs itself (yet)
        runner.cuda_graphs = maybe_capture_cuda_graphs((1, 2, 4, 8), runner.model, runner.backend,
                                                       runner.kv_caches, engine.config.block_size,
                                                       engine.max_model_len, engine.device)
    assert runner.cuda_graphs is not None

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 128256) for _ in range(n)] for n in PROMPT_LENS]
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    logprobs: dict[str, list[float]] = {str(i): [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(str(i), tuple(p), SamplingParams(),
                                         StoppingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)))
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
            logprobs[out.request_id].extend(out.logprobs)
    replays = runner.cuda_graphs.num_replays
    del engine, runner
    torch.cuda.empty_cache()

    hf = hf.float().eval()
    report: list[str] = []
    failures: list[str] = []
    exact_total = 0
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            ours = tokens[str(i)]
            assert len(ours) == NEW_TOKENS
            ids = torch.tensor([prompt], device="cuda")
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True)
            theirs = gen.sequences[0, len(prompt):].tolist()
            free_logits = torch.cat(gen.logits).float()  # [N, V]
            top2 = free_logits.topk(2, dim=-1).values
            margins = (top2[:, 0] - top2[:, 1]).tolist()
            clear = next((j for j, m in enumerate(margins) if m < MARGIN), NEW_TOKENS)
            exact_total += clear
            if ours[:clear] != theirs[:clear]:
                failures.append(f"prompt {i}: first {clear} clear-margin tokens differ: {ours[:clear]} vs {theirs[:clear]}")
            # Teacher-forced on our tokens.
            forced = hf(torch.tensor([prompt + ours], device="cuda")).logits[0].float()
            rows = forced[len(prompt) - 1 : len(prompt) - 1 + NEW_TOKENS]  # [N, V]
            chosen = rows.gather(1, torch.tensor(ours, device="cuda")[:, None])[:, 0]
            gaps = (rows.max(dim=1).values - chosen).tolist()
            hf_lps = torch.log_softmax(rows, dim=-1).gather(1, torch.tensor(ours, device="cuda")[:, None])[:, 0]
            lp_err = (hf_lps - torch.tensor(logprobs[str(i)], device="cuda")).abs().max().item()
            argmax_agree = sum(g == 0.0 for g in gaps)
            report.append(f"prompt {i} (len {len(prompt)}): clear-margin prefix {clear}/{NEW_TOKENS}, "
                          f"free-running equal prefix {next((j for j, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), NEW_TOKENS)}, "
                          f"teacher-forced argmax agreement {argmax_agree}/{NEW_TOKENS}, max gap {max(gaps):.3f}, "
                          f"max |logprob diff| {lp_err:.3f}")
            if max(gaps) > TIE_TOL:
                failures.append(f"prompt {i}: a chosen token is {max(gaps):.3f} below transformers' best logit")
            if lp_err > LOGPROB_TOL:
                failures.append(f"prompt {i}: logprob differs by {lp_err:.3f}")
    print("\n".join(report), f"\ncuda graph replays: {replays}; clear-margin tokens compared exactly: {exact_total}")
    assert replays > 0, "decode never used a CUDA graph"
    assert not failures, "\n".join(failures + report)
    assert exact_total >= len(prompts), "too few clear-margin tokens to compare exactly"
