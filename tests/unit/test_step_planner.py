"""The step planner's flat rows: every row's KV slot is ``table[p // block] * block + p % block``."""

from __future__ import annotations

import random

from loom.engine.scheduler import SchedulerOutput
from loom.engine.sequence import Sequence
from loom.engine.step_planner import plan_step
from loom.engine.types import EngineRequest, SamplingParams, StoppingParams


def _seq(prompt: int, rng: random.Random, pool: list[int], block: int) -> Sequence:
    request = EngineRequest(f"r{rng.random()}", tuple(rng.randrange(3, 500) for _ in range(prompt)),
                            SamplingParams(), StoppingParams(max_new_tokens=8))
    seq = Sequence(request, 0, None)
    seq.block_table = [pool.pop() for _ in range(-(-(prompt + 8) // block))]
    return seq


def test_slots_follow_the_block_tables_for_prefill_chunks_decodes_and_drafts() -> None:
    block = 16
    rng = random.Random(5)
    pool = list(range(400))
    rng.shuffle(pool)  # scattered blocks: a slot is right only through the table
    chunk = _seq(300, rng, pool, block)  # a prefill chunk starting and ending inside blocks
    chunk.num_computed_tokens = 37
    whole = _seq(33, rng, pool, block)  # a whole prompt
    one = _seq(1, rng, pool, block)  # a one-token prompt (one row, at position 0)
    decode = _seq(50, rng, pool, block)  # a decode row at the last position
    decode.num_computed_tokens = 49
    verify = _seq(47, rng, pool, block)  # the last token and three drafts, across a block edge
    verify.num_computed_tokens = 46
    sched = SchedulerOutput(seqs=[chunk, whole, one, decode, verify], num_new_tokens=[200, 33, 1, 1, 4])
    planned = plan_step(sched, block, 500, (2,), drafts={verify.seq_id: [7, 8, 9]})
    want: list[int] = []
    for seq, n in zip(sched.seqs, sched.num_new_tokens, strict=True):
        start = seq.num_computed_tokens
        want += [seq.block_table[p // block] * block + p % block for p in range(start, start + n)]
    assert planned.plan.slot_mapping == want
    assert planned.plan.positions == [p for s, n in zip(sched.seqs, sched.num_new_tokens, strict=True)
                                      for p in range(s.num_computed_tokens, s.num_computed_tokens + n)]
