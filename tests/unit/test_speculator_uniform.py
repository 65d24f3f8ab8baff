"""The speculator's step shapes: on CUDA (pad_to_k) a step whose decode rows verify drafts gives every
row k + 1 tokens, sequences backing off after rejections included (filler drafts, not counted
against them), so that the step replays a captured graph; on the CPU a resting row decodes alone."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from loom.engine.block_manager import BlockManager
from loom.engine.scheduler import Scheduler, SchedulerConfig
from loom.engine.sequence import Sequence
from loom.engine.types import EngineRequest, StoppingParams
from loom.plugin_api import DraftRequest, Proposer
from loom.spec.speculator import Speculator


class Fixed(Proposer):
    """Proposes 3, 4, 5, ... up to the room asked for."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def propose(self, requests: Seq[DraftRequest]) -> list[list[int]]:
        self.asked += [r.seq_id for r in requests]
        return [list(range(3, 3 + r.max_drafts)) for r in requests]


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


def test_resting_rows_verify_filler_so_the_step_stays_uniform_on_cuda() -> None:
    for pad_to_k, widths in ((True, [5, 5, 5]), (False, [5, 1, 5])):
        sched, bm = decoding(3)
        proposer = Fixed()
        spec = Speculator(proposer, 4, max_batch_size=32, vocab_size=100, max_model_len=100, pad_to_k=pad_to_k)
        resting = sched.running[1]
        for _ in range(3):  # all rejected, three times: its acceptance falls below the bar
            spec.observe(resting, 4, 0)
        assert spec._stats[resting.seq_id].backoff > 0
        step = sched.schedule()
        drafts = spec.add_drafts(step, bm, len(sched.running))
        assert step.num_new_tokens == widths, pad_to_k
        assert resting.seq_id not in proposer.asked  # a resting sequence is not proposed for
        if pad_to_k:
            assert drafts[resting.seq_id] == [9, 9, 9, 9]  # its last token repeated
            before = (spec.counters.draft_tokens, spec.counters.accepted_tokens)
            spec.observe(resting, 4, 4)  # filler accepted (the model repeats itself) ...
            assert spec._stats[resting.seq_id].rate < 0.25  # ... says nothing about its proposals,
            assert (spec.counters.draft_tokens, spec.counters.accepted_tokens) == before  # nor its counts
            assert spec.counters.filler_tokens == 4
            assert spec.proposed(resting.seq_id, 4) == 0  # usage and metrics report no drafts for it
            guessing = sched.running[0]
            assert spec.proposed(guessing.seq_id, 4) == 4
        else:
            assert resting.seq_id not in drafts
