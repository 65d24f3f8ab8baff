"""The speculator's step shapes: on CUDA (pad_to_k) a step whose decode rows verify drafts gives every
row k + 1 tokens, sequences backing off after rejections included (their proposer's guess, or
filler drafts not counted for or against them), so that the step replays a captured graph; on
the CPU a resting row decodes alone."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from loom.engine.block_manager import BlockManager
from loom.engine.scheduler import Scheduler, SchedulerConfig
from loom.engine.sequence import Sequence
from loom.engine.types import EngineRequest, StoppingParams
from loom.plugin_api import DraftRequest, Proposer
from loom.spec.speculator import Speculator


class Fixed(Proposer):
    """Proposes 3, 4, 5, ... up to the room asked for (nothing for the sequences in ``silent``)."""

    def __init__(self, silent: tuple[int, ...] = ()) -> None:
        self.asked: list[list[int]] = []  # seq_ids of each propose call
        self.silent = silent

    def propose(self, requests: Seq[DraftRequest]) -> list[list[int]]:
        self.asked.append([r.seq_id for r in requests])
        return [[] if r.seq_id in self.silent else list(range(3, 3 + r.max_drafts)) for r in requests]


def decoding(n: int) -> tuple[Scheduler, BlockManager]:
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_batch_prefill_tokens=100), bm)
    for i in range(n):
        sched.add(Sequence(EngineRequest(f"r{i}", (1, 2, 3, 4, 5), stopping=StoppingParams(max_new_tokens=50)), i,
                           None))
    out = sched.schedule()  # the prompts
    for seq, m in zip(out.seqs, out.num_new_tokens, strict=True):
        seq.num_computed_tokens += m
        seq.token_ids.append(9)
    return sched, bm


def _resting_step(pad_to_k: bool, silent: bool) -> tuple[Speculator, Fixed, Sequence, dict[int, list[int]], list[int]]:
    """Three decoding sequences, the middle one backing off after three rejections; one step."""
    sched, bm = decoding(3)
    resting = sched.running[1]
    proposer = Fixed(silent=(resting.seq_id,) if silent else ())
    spec = Speculator(proposer, 4, max_batch_size=32, vocab_size=100, max_model_len=100, pad_to_k=pad_to_k)
    for _ in range(3):  # all rejected, three times: its acceptance falls below the bar
        spec.observe(resting, 4, 0)
    assert spec._stats[resting.seq_id].backoff > 0
    step = sched.schedule()
    drafts = spec.add_drafts(step, bm, len(sched.running))
    return spec, proposer, resting, drafts, step.num_new_tokens


def test_resting_rows_decode_alone_on_the_cpu() -> None:
    _spec, proposer, resting, drafts, widths = _resting_step(pad_to_k=False, silent=False)
    assert widths == [5, 1, 5]
    assert resting.seq_id not in drafts and all(resting.seq_id not in call for call in proposer.asked)


def test_resting_rows_verify_their_proposal_when_the_cuda_step_verifies_anyway() -> None:
    """The step gives every row k + 1 tokens for its graph: a resting row pays for them whatever it
    verifies, so it verifies its proposer's guess, counted as drafts like any other."""
    spec, proposer, resting, drafts, widths = _resting_step(pad_to_k=True, silent=False)
    assert widths == [5, 5, 5]
    assert resting.seq_id not in proposer.asked[0] and proposer.asked[1] == [resting.seq_id]
    assert drafts[resting.seq_id] == [3, 4, 5, 6]
    assert spec.proposed(resting.seq_id, 4) == 4
    spec.observe(resting, 4, 4)  # all accepted: its rate rises
    assert spec._stats[resting.seq_id].rate > 0.2 and spec.counters.filler_tokens == 0


def test_resting_rows_without_a_proposal_verify_filler_not_counted() -> None:
    spec, _proposer, resting, drafts, widths = _resting_step(pad_to_k=True, silent=True)
    assert widths == [5, 5, 5]
    assert drafts[resting.seq_id] == [9, 9, 9, 9]  # its last token repeated
    before = (spec.counters.draft_tokens, spec.counters.accepted_tokens)
    spec.observe(resting, 4, 4)  # filler accepted (the model repeats itself) ...
    assert spec._stats[resting.seq_id].rate < 0.25  # ... says nothing about its proposals,
    assert (spec.counters.draft_tokens, spec.counters.accepted_tokens) == before  # nor its counts
    assert spec.counters.filler_tokens == 4
    assert spec.proposed(resting.seq_id, 4) == 0  # usage and metrics report no drafts for it


def test_acceptance_is_counted_per_draft_position() -> None:
    """Per position: drafts there, drafts reached (every earlier one accepted), drafts accepted;
    the conditional acceptance is what the cost model chains (docs/speculative.md)."""
    sched, _ = decoding(2)
    a, b = sched.running
    spec = Speculator(Fixed(), 4, max_batch_size=32, vocab_size=100, max_model_len=100, pad_to_k=False)
    spec.observe(a, 4, 4)  # all four accepted
    spec.observe(a, 4, 1)  # the first only
    spec.observe(b, 2, 2)  # a shorter guess, both accepted
    c = spec.counters
    assert c.proposed_at == [3, 3, 2, 2]
    assert c.reached_at == [3, 3, 1, 1]  # position 2: only the first verification got past position 1
    assert c.accepted_at == [3, 2, 1, 1]
    assert c.acceptance_at() == [1.0, 2 / 3, 0.5, 0.5]
    assert c.conditional_acceptance_at() == [1.0, 2 / 3, 1.0, 1.0]
    assert sum(c.accepted_at) == c.accepted_tokens == 7
