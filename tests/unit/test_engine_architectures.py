"""Mixtral, Qwen3-MoE, Gemma 2 / 3 and Phi-3 through the engine on CPU (fp32), against transformers.

Each tiny random model (tests/helpers/tiny_models.py) serves a batch of requests that join at
different steps, one of them with a prompt several times its sliding window, and must give
transformers' greedy tokens with logprobs within 1e-4 of transformers' own (the log-softmax of
the logits ``generate`` computed at each step); then the same requests in a pool too small for
them (preempted and recomputed) give the same tokens, and a prompt that shares the long prompt's
blocks (a prefix cache hit on sliding-window layers) gives transformers' tokens too.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.tiny_models import load_hf_reference

from loom.config import EngineConfig
from loom.engine.llm_engine import LLMEngine
from loom.engine.types import EngineOutput, EngineRequest, SamplingParams, StoppingParams

# tiny model -> (the architecture it names, its sliding window or None); qwen3-moe-norm-topk differs
# from qwen3-moe only by the renormalised routing, checked in test_fused_moe.py and
# test_models_parity.py.
ARCHS: dict[str, tuple[str, int | None]] = {
    "mixtral": ("MixtralForCausalLM", 6),
    "qwen3-moe": ("Qwen3MoeForCausalLM", None),
    "gemma2": ("Gemma2ForCausalLM", 5),
    "gemma3": ("Gemma3ForCausalLM", 5),
    "phi3": ("Phi3ForCausalLM", 7),
    "phi3-longrope": ("Phi3ForCausalLM", None),
}
LOGPROB_TOL = 1e-4
VOCAB = 320


def _requests(seed: int, max_len: int | None) -> list[tuple[str, list[int], int]]:
    """(id, prompt, new tokens): a 40-token prompt (many windows long) and shorter ones; with
    ``max_len``, every sequence is cut to that many tokens."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(3, VOCAB) for _ in range(n)]  # noqa: E731
    reqs = [("long", ids(40), 12), ("a", ids(7), 9), ("b", ids(3), 14), ("d", ids(25), 16), ("c", ids(11), 5)]
    if max_len is None:
        return reqs
    return [(rid, p[:max_len - 6], min(new, max_len - len(p[:max_len - 6]))) for rid, p, new in reqs]


def _run(engine: LLMEngine, reqs: list[tuple[str, list[int], int]],
         arrivals: dict[str, int]) -> dict[str, list[EngineOutput]]:
    pending = sorted(reqs, key=lambda r: arrivals.get(r[0], 0))
    outs: dict[str, list[EngineOutput]] = {rid: [] for rid, _, _ in reqs}
    step = 0
    while pending or engine.has_unfinished():
        while pending and arrivals.get(pending[0][0], 0) <= step:
            rid, prompt, new = pending.pop(0)
            engine.add_request(EngineRequest(rid, tuple(prompt), SamplingParams(),
                                             StoppingParams(max_new_tokens=new, ignore_eos=True)))
        for out in engine.step():
            outs[out.request_id].append(out)
        step += 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "KV blocks leaked"
    return outs


def _tokens(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def _hf_greedy(hf: Any, prompt: list[int], new: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens and, per step, the log-softmax of the logits it chose from."""
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                      output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [s[0].float().log_softmax(-1) for s in out.logits]


@pytest.mark.parametrize("variant", sorted(ARCHS))
def test_greedy_tokens_and_logprobs_equal_transformers(variant: str, tiny_model_dir: Callable[[str], Path]) -> None:
    path = tiny_model_dir(variant)
    architecture, window = ARCHS[variant]
    # LongRoPE: a sequence longer than the original 32 positions is re-encoded by transformers
    # with the long factors, where Loom keeps its first keys (see loom.layers.rotary; the long
    # factors themselves are checked in test_rotary.py): such sequences are left out.
    max_len = 32 if variant == "phi3-longrope" else None
    reqs = _requests(seed=len(variant), max_len=max_len)
    assert window is None or len(reqs[0][1]) > 4 * window
    hf = load_hf_reference(path)
    expected = {rid: _hf_greedy(hf, prompt, new) for rid, prompt, new in reqs}

    # Roomy: requests join while others prefill (16-token chunks) and decode.
    engine = LLMEngine(EngineConfig(model_id=str(path), block_size=4, max_batch_total_tokens=2048,
                                    max_batch_prefill_tokens=16))
    assert engine.info.architecture == type(engine.worker.model).__name__ == architecture
    arrivals = {"long": 0, "a": 0, "b": 2, "cross": 3, "c": 6}
    got = _run(engine, reqs, arrivals)
    for rid, _, _ in reqs:
        tokens, ref_logprobs = expected[rid]
        assert _tokens(got[rid]) == tokens, f"{variant} request {rid}"
        ours = [lp for o in got[rid] for lp in o.logprobs]
        theirs = [ref[t].item() for ref, t in zip(ref_logprobs, tokens, strict=True)]
        assert ours == pytest.approx(theirs, abs=LOGPROB_TOL), f"{variant} request {rid}'s logprobs"

    # Tight: a pool two blocks larger than the longest sequence: the others are preempted and
    # recomputed.
    pool = -(-max(len(p) + n for _, p, n in reqs) // 4) * 4 + 8
    tight = LLMEngine(EngineConfig(model_id=str(path), block_size=4, max_batch_total_tokens=pool,
                                   max_total_tokens=pool, max_batch_prefill_tokens=16))
    again = _run(tight, reqs, {})
    assert tight.scheduler.num_preemptions > 0
    assert {rid: _tokens(o) for rid, o in again.items()} == {rid: expected[rid][0] for rid, _, _ in reqs}

    # The prefix cache on sliding-window layers: the long prompt's blocks are reused.
    long_prompt = reqs[0][1]
    shared = (*long_prompt[:-3], 9, 10, 11)
    new = 8 if max_len is None else min(8, max_len - len(shared))
    engine.add_request(EngineRequest("shared", shared, SamplingParams(),
                                     StoppingParams(max_new_tokens=new, ignore_eos=True)))
    outs: list[EngineOutput] = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[0].num_cached_tokens >= len(long_prompt) - 3 - 4  # every full block before the change
    assert _tokens(outs) == _hf_greedy(hf, list(shared), new)[0]
