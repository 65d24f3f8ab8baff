"""On a real GPU, a draft model's catch-ups replay CUDA graphs (``draft_catch_up``) and give the
drafts of the eager path; at batch 1 they write its very KV bytes.

A random-weight tiny Llama as an int4 (GPTQ while loading) draft, on the W4A16 kernels, as W5 b's
int4 llama-8b. Two proposers get the same calls: one with the catch-up graphs
(the default, set by the test), one without (catch-ups eager, ``LOOM_DRAFT_CATCH_UP_GRAPHS=0``). The calls follow W5 b's pattern:
a prompt, then catch-ups over rejected guesses of 1 to 130 tokens (back-offs of up to 64 steps
give 65).

- batch 1, bf16: every catch-up of 3 to 128 tokens replays a graph (none does with the switch
  off), the drafts are equal, and so are the pools byte for byte (docs/speculative.md: the
  widths are the W4A16 GEMM's row tiles, so the real rows run the eager step's tile plan);
- 1 to 3 sequences a call, float32: every step the layout says a graph serves replays one, and
  the drafts are equal (with several sequences the rows' count crosses GEMM tile sizes: equal
  to float32 rounding, not bit for bit, as the eager path's own rows depend on their batch);
- W5 b in miniature through an engine: the draft's catch-ups after back-offs replay graphs.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

Log = list[tuple[list[int], int | None, bool]]  # per draft step: new tokens, laid-out width, replayed


def _proposer(dtype: str, catch_up_graphs: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    from loom import kernel_switches
    from loom.plugin_api import ProposerContext
    from loom_plugins.speculative.draft_model import DraftModelProposer

    monkeypatch.setattr(kernel_switches, "draft_catch_up_graphs", catch_up_graphs)
    context = ProposerContext(num_speculative_tokens=3, vocab_size=1024, device="cuda", dtype=dtype,
                              options={"model_id": "random:tiny-llama", "quantize": "gptq", "kv_tokens": "8192"},
                              max_model_len=1024, max_batch_size=4)
    proposer = DraftModelProposer(context)
    assert [m for m in proposer.worker.model.modules() if "w4a16" in m.__dict__], "not on the W4A16 kernels"
    return proposer


def _logging(proposer: Any) -> Log:
    """Record each draft step: its sequences' new tokens, the width it was laid out at, whether
    a graph replayed."""
    log: Log = []
    step = proposer._step
    graphs = proposer.worker.runner.cuda_graphs
    assert graphs is not None

    def recording(seqs: list[Any]) -> list[int]:
        new = [len(st.tokens) - st.computed for st in seqs]
        catch_up = proposer._catch_up
        width = catch_up.width(new, [len(st.tokens) for st in seqs]) if catch_up is not None else None
        before = graphs.num_replays
        out: list[int] = step(seqs)
        log.append((new, width, graphs.num_replays > before))
        return out

    proposer._step = recording
    return log


def _batch_1_calls() -> list[list[int]]:
    """One sequence's token lists, call by call: a 200-token prompt, then the target's tokens
    since the last call (the guesses all rejected): catch-ups of these many tokens."""
    rng = random.Random(1)
    tokens = [rng.randrange(3, 1000) for _ in range(200)]
    calls = [list(tokens)]
    for add in (1, 2, 5, 9, 17, 33, 65, 65, 3, 16, 99, 128, 130, 1, 40):
        tokens += [rng.randrange(3, 1000) for _ in range(add)]
        calls.append(list(tokens))
    return calls


@pytest.fixture(scope="module")
def batch_1_runs() -> tuple[Log, Log, list[list[int]], list[list[int]], bool]:
    """The batch-1 calls through both proposers (bf16): their logs, drafts and whether the pools
    are equal byte for byte."""
    from loom.plugin_api import DraftRequest

    with pytest.MonkeyPatch.context() as mp:
        as_is = _proposer("bfloat16", False, mp)
        graphed = _proposer("bfloat16", True, mp)
    logs = _logging(as_is), _logging(graphed)
    drafts: tuple[list[list[int]], list[list[int]]] = ([], [])
    for tokens in _batch_1_calls():
        for p, out in zip((as_is, graphed), drafts, strict=True):
            out += p.propose([DraftRequest(0, tokens, 3)])
    torch.cuda.synchronize()
    same = all(torch.equal(a, b) for a, b in zip(as_is.worker.runner.kv_caches, graphed.worker.runner.kv_caches,
                                                  strict=True))
    return logs[0], logs[1], drafts[0], drafts[1], same


def test_catch_ups_replay_graphs_and_give_the_eager_drafts(batch_1_runs: tuple[Log, Log, Any, Any, bool]) -> None:
    eager_log, graph_log, eager_drafts, graph_drafts, _ = batch_1_runs
    assert graph_drafts == eager_drafts
    catch_ups = [(new[0], width, replayed) for new, width, replayed in graph_log if new[0] > 2]
    assert len(catch_ups) >= 12 and {w for _, w, _ in catch_ups} >= {16, 32, 64, 128}
    for n, _, replayed in catch_ups:  # the prompt's first call (200) and the 130-token one: eagerly
        assert replayed == (n <= 128), n
    assert not any(replayed for new, _, replayed in eager_log if new[0] > 2)  # the switch off: as before
    assert all(replayed for new, _, replayed in graph_log if new[0] <= 2)  # decode steps: graphs, as before


def test_catch_ups_at_batch_1_write_the_eager_kv_bytes(batch_1_runs: tuple[Log, Log, Any, Any, bool]) -> None:
    assert batch_1_runs[4], "the pools differ: a graphed catch-up's real rows are not the eager step's bits"


def test_catch_ups_of_several_sequences_replay_graphs_and_give_the_eager_drafts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from loom.plugin_api import DraftRequest

    as_is = _proposer("float32", False, monkeypatch)
    graphed = _proposer("float32", True, monkeypatch)
    log = _logging(graphed)
    rng = random.Random(2)
    tokens: dict[int, list[int]] = {}
    for _ in range(40):
        live = rng.sample(range(4), rng.randint(1, 3))
        for sid in live:
            seq = tokens.setdefault(sid, [rng.randrange(3, 1000) for _ in range(rng.randint(20, 200))])
            seq += [rng.randrange(3, 1000) for _ in range(rng.choice([1, 2, 3, 5, 9, 17, 33, 65]))]
            if len(seq) > 800:
                as_is.release(sid)
                graphed.release(sid)
                tokens[sid] = seq[-rng.randint(1, 300):]
        requests = [DraftRequest(sid, tokens[sid], 3) for sid in live]
        assert graphed.propose(requests) == as_is.propose(requests)
    laid_out = [(new, width, replayed) for new, width, replayed in log if max(new) > 2 and width is not None]
    assert len(laid_out) >= 20 and {w for _, w, _ in laid_out} >= {16, 32, 64, 128}
    assert all(replayed == (width is not None) for _, width, replayed in log)


def test_w5b_in_miniature_replays_the_catch_ups_after_back_offs(monkeypatch: pytest.MonkeyPatch) -> None:
    from loom import kernel_switches
    from loom.config import EngineConfig
    from loom.engine.llm_engine import LLMEngine
    from loom.engine.types import EngineRequest, SamplingParams, StoppingParams

    monkeypatch.setattr(kernel_switches, "draft_catch_up_graphs", True)
    engine = LLMEngine(EngineConfig(model_id="random:tiny-llama", device="cuda", dtype="bfloat16",
                                    max_batch_total_tokens=16384, speculate=3, speculator="draft",
                                    speculator_options=(("model_id", "random:tiny-llama"), ("quantize", "gptq"),
                                                        ("kv_tokens", "8192"))))
    assert engine.speculator is not None
    proposer = engine.speculator.proposer
    log = _logging(proposer)
    engine.add_request(EngineRequest("w5b", tuple(range(10, 160)), SamplingParams(),
                                     StoppingParams(max_new_tokens=200, ignore_eos=True)))
    while engine.has_unfinished():
        engine.step()
    assert engine.speculator.counters.verifications >= 6  # back-offs ended, catch-ups followed
    catch_ups = [(new[0], replayed) for new, _, replayed in log[1:] if new[0] > 2]  # after the prompt's call
    assert len(catch_ups) >= 3 and all(replayed for _, replayed in catch_ups), catch_ups

