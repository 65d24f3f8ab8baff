"""Nothing compiles after SERVING: the draft model's warm-up covers every step shape its serving
can take that no CUDA graph serves (CPU, with the H200's W4A16 plans computed for llama-8b).

W5 b's first timed run reached half the cost model's speed: the draft's catch-ups (the target's
tokens since its last proposal: 5, 9, 17, 33, 65 after back-offs of 4..64 steps) run eagerly,
and each new token-count bucket made Triton compile W4A16 GEMM variants in the middle of the
run. Here: the plan-level model of what a count compiles (``w4a16_triton.launch_variant``)
covers every count with the few the warm-up runs, and the draft proposer, after its warm-up,
runs only steps whose kernels the warm-up launched (the W4A16 variants of llama-8b's layers on
132 SMs, and the attention's launch kinds), through an engine whose int4 draft keeps being
rejected and backs off (the W5 b pattern) and through catch-ups of every size."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import quant_layers as ql

from loom.config import EngineConfig
from loom.engine.llm_engine import LLMEngine
from loom.engine.types import EngineRequest, SamplingParams, StoppingParams
from loom.plugin_api import DraftRequest
from loom.worker.kernel_warmup import WarmUpCounts
from loom.worker.worker import Worker
from loom_plugins.quant import w4a16_layout as wl
from loom_plugins.quant import w4a16_triton as wt
from loom_plugins.speculative import draft_model as dm

H200_SMS = 132
# llama-8b's linear layers as (inputs, segment widths): qkv, o, gate_up, down
LLAMA_8B = [(4096, (6144,)), (4096, (4096,)), (4096, (28672,)), (14336, (4096,))]
# odd shapes: SmolLM2's qkv, a fused layer of two segments, a per-channel layer (group = K)
ODD = [(576, (960,)), (576, (576, 384)), (1536, (576,))]


def _variants(m: int, layers: list[tuple[int, tuple[int, ...]]], group: int = 128) -> set[tuple[Any, ...]]:
    return {(i, wt.launch_variant(m, k, group if k % group == 0 else k, widths, H200_SMS))
            for i, (k, widths) in enumerate(layers)}


def _cover(layers: list[tuple[int, tuple[int, ...]]], max_tokens: int, group: int = 128) -> tuple[int, ...]:
    counts: set[int] = set()
    for k, widths in layers:
        counts.update(wt.covering_token_counts(k, group if k % group == 0 else k, widths, max_tokens, H200_SMS))
    return tuple(sorted(counts))


@pytest.mark.parametrize("layers", [LLAMA_8B, ODD], ids=["llama-8b", "odd"])
def test_a_few_counts_compile_every_variant_any_count_launches(layers: list[tuple[int, tuple[int, ...]]]) -> None:
    counts = _cover(layers, 8192)
    warmed = set().union(*(_variants(c, layers) for c in counts))
    for m in range(1, 8193):
        assert _variants(m, layers) <= warmed, m
    assert len(counts) <= 24 and counts[0] == 1 and counts[-1] == wt.DENSE_FROM_TOKENS


def test_the_variant_model_tells_the_buckets_of_w5b_catch_ups_apart() -> None:
    """W5 b's catch-ups after back-offs of 4, 8, 16, 32, 64 steps: 5 and 9 share a variant (the
    untimed run's), 17, 33 and 65 are each new (what the first timed run compiled)."""
    v = {m: _variants(m, LLAMA_8B) for m in (5, 9, 17, 33, 65, 513)}
    assert v[5] == v[9]
    assert len({frozenset(v[m]) for m in (9, 17, 33, 65, 513)}) == 5
    assert _variants(16, LLAMA_8B) != _variants(15, LLAMA_8B)  # M = 16 is specialised (a multiple of 16)


def test_a_repacked_layer_asks_for_its_counts_and_others_for_none() -> None:
    scheme = ql.while_loading_scheme("gptq")
    layer = ql.build_layer(scheme, 256, [64, 32, 32], ql.dense_parts(256, [64, 32, 32], seed=1), "cpu",
                           torch.float32)
    method = layer.quant_method
    assert list(method.warm_up_token_counts(layer, 4096)) == []  # not repacked (CPU): the torch path
    layer.w4a16_dtype = torch.float32
    method.to_layout(layer).register(layer)
    counts = list(method.warm_up_token_counts(layer, 4096))
    assert counts == list(wt.covering_token_counts(256, layer.w4a16.group_size, (128,), 4096, wt.sm_count(
        torch.device("cpu"))))
    assert counts[0] == 1 and 2 in counts
    assert list(method.warm_up_token_counts(layer, 40)) == [c for c in counts if c <= 40]
    assert isinstance(layer.w4a16, wl.W4A16Layout)


# -- the draft proposer -----------------------------------------------------------------------------
def _attention_launches(query_lens: list[int]) -> set[tuple[str, bool]]:
    """The paged backend's launches for a step (plugins/attention/paged_triton.py): (kind,
    whether it is told its sequences by an index tensor)."""
    if len(set(query_lens)) == 1:
        return {("decode" if query_lens[0] == 1 else "prefill", False)}
    if 1 in query_lens:
        return {("decode", True), ("prefill", True)}
    return {("prefill", False)}


def _kernels(query_lens: list[int]) -> set[Any]:
    """What an eager draft step of these query lengths compiles on the H200 (llama-8b int4)."""
    return _variants(sum(query_lens), LLAMA_8B) | _attention_launches(query_lens)


class _Recorder:
    """The draft's steps (each sequence's new tokens), marked as warm-up or serving."""

    def __init__(self) -> None:
        self.warm: list[list[int]] = []
        self.serving: list[list[int]] = []
        self.phase = self.warm


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Recorder]:
    rec = _Recorder()
    step = dm.DraftModelProposer._step

    def recording(self: dm.DraftModelProposer, seqs: list[Any]) -> list[int]:
        rec.phase.append([len(st.tokens) - st.computed for st in seqs])
        return step(self, seqs)

    def h200_counts(self: Worker, max_tokens: int, max_rows: int) -> WarmUpCounts:
        return WarmUpCounts(tuple(c for c in _cover(LLAMA_8B, max_tokens)), ())

    monkeypatch.setattr(dm.DraftModelProposer, "_step", recording)
    monkeypatch.setattr(Worker, "warm_up_token_counts", h200_counts)
    yield rec


def _graph_served(query_lens: list[int], proposer: dm.DraftModelProposer) -> bool:
    """On CUDA the draft replays graphs for steps whose every sequence has 1 or 2 new tokens.
    (Catch-ups laid out at a catch-up width replay graphs too; they stay in the check: the same
    token counts run eagerly where a sequence is shorter than the width or the batch larger than
    the graphs', so the warm-up covers them all the same.)"""
    sizes = dm._graph_sizes(proposer.context.max_batch_size)
    return len(set(query_lens)) == 1 and query_lens[0] in (1, 2) and len(query_lens) <= sizes[-1]


def _assert_serving_was_warmed(rec: _Recorder, proposer: dm.DraftModelProposer) -> None:
    warmed = set().union(*(_kernels(q) for q in rec.warm if not _graph_served(q, proposer)))
    eager = [q for q in rec.serving if not _graph_served(q, proposer)]
    assert eager, "no eager draft step while serving: nothing tested"
    for q in eager:
        assert _kernels(q) <= warmed, (q, _kernels(q) - warmed)


def _engine(kv_tokens: int = 4096) -> LLMEngine:
    """W5 b in miniature: a random-weight target and its int4 (RTN) copy as the draft."""
    return LLMEngine(EngineConfig(model_id="random:tiny-llama", speculate=3, speculator="draft",
                                  speculator_options=(("model_id", "random:tiny-llama"), ("quantize", "gptq"),
                                                      ("kv_tokens", str(kv_tokens)))))


def test_draft_steps_after_warm_up_launch_only_warmed_kernels(recorder: _Recorder) -> None:
    """The W5 b pattern: no draft accepted, back-offs of 4..64, catch-ups of 5..65 tokens after
    the prompt's own; every eager step's kernels were launched by the warm-up."""
    engine = _engine()
    recorder.phase = recorder.serving
    engine.add_request(EngineRequest("w5b", tuple(range(10, 60)), SamplingParams(),
                                     StoppingParams(max_new_tokens=200, ignore_eos=True)))
    while engine.has_unfinished():
        engine.step()
    assert engine.speculator is not None
    proposer = engine.speculator.proposer
    assert isinstance(proposer, dm.DraftModelProposer)
    caught_up = sorted({sum(q) for q in recorder.serving})
    assert {51, 17, 33, 65} <= set(caught_up)  # the prompt's step, and catch-ups after long back-offs
    _assert_serving_was_warmed(recorder, proposer)
    engine.speculator.release_finished()  # (done at the next step that speculates)
    assert proposer.num_free_blocks == proposer.num_blocks


def test_catch_ups_of_every_size_and_mix_launch_only_warmed_kernels(recorder: _Recorder) -> None:
    """The proposer driven directly: up to three sequences a call, each catching up on 1 to 120
    tokens (rejected guesses rolled back), restarted past 400 tokens."""
    engine = _engine()
    assert engine.speculator is not None
    proposer = engine.speculator.proposer
    assert isinstance(proposer, dm.DraftModelProposer)
    recorder.phase = recorder.serving
    rng = random.Random(0)
    tokens: dict[int, list[int]] = {}
    limit = 400  # five sequences of this many tokens fit the draft's pool
    for _ in range(60):
        live = rng.sample(range(5), rng.randint(1, 3))
        for sid in live:
            seq = tokens.setdefault(sid, [rng.randrange(3, 1000) for _ in range(rng.randint(1, 200))])
            seq += [rng.randrange(3, 1000) for _ in range(rng.choice([1, 2, 3, 7, 16, 31, 48, 64, 99, 120]))]
            if len(seq) > limit:
                proposer.release(sid)
                tokens[sid] = seq[-rng.randint(1, 300):]
        drafts = proposer.propose([DraftRequest(sid, tokens[sid], 3) for sid in live])
        assert all(len(d) == 3 for d in drafts)
    for sid in tokens:
        proposer.release(sid)
    assert proposer.num_free_blocks == proposer.num_blocks
    _assert_serving_was_warmed(recorder, proposer)
