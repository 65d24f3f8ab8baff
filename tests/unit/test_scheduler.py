"""Scheduler: admission order, budgets, the waiting-served gate, preemption of the youngest."""

from __future__ import annotations

from loom.engine.block_manager import BlockManager
from loom.engine.scheduler import Scheduler, SchedulerConfig
from loom.engine.sequence import Sequence, SequenceStatus
from loom.engine.types import EngineRequest


def make(num_blocks: int = 16, block_size: int = 4, chunked: bool = False, **kw: float) -> Scheduler:
    cfg = SchedulerConfig(max_batch_prefill_tokens=int(kw.pop("prefill", 64)),
                          enable_chunked_prefill=chunked, **kw)  # type: ignore[arg-type]
    return Scheduler(cfg, BlockManager(num_blocks, block_size))


def seq(rid: str, n: int) -> Sequence:
    return Sequence(EngineRequest(rid, tuple(range(1, n + 1))), 0, None)


def run_step(s: Scheduler) -> list[tuple[str, int]]:
    """Schedule, then pretend the forward ran and every row sampled a token."""
    out = s.schedule()
    for q, n in zip(out.seqs, out.num_new_tokens, strict=True):
        q.num_computed_tokens += n
        q.token_ids.append(7)
    return [(q.request_id, n) for q, n in zip(out.seqs, out.num_new_tokens, strict=True)]


def test_fifo_admission_within_prefill_budget() -> None:
    s = make(prefill=10)
    for rid, n in [("a", 4), ("b", 5), ("c", 3)]:
        s.add(seq(rid, n))
    assert run_step(s) == [("a", 4), ("b", 5)]  # c would exceed 10 prefill tokens
    assert [q.request_id for q in s.waiting_in_order()] == ["c"]
    # next step: a and b decode, c joins (1 waiting >= floor(2 * 0.3) = 0 -> at least 1)
    assert run_step(s) == [("a", 1), ("b", 1), ("c", 3)]


def test_first_prompt_may_exceed_budget_alone() -> None:
    s = make(prefill=4)
    s.add(seq("big", 9))
    assert run_step(s) == [("big", 9)]


def test_block_tables_are_exact() -> None:
    s = make(num_blocks=8, block_size=4)
    a, b = seq("a", 5), seq("b", 3)
    s.add(a)
    s.add(b)
    run_step(s)
    assert a.block_table == [0, 1] and b.block_table == [2]
    run_step(s)  # a at position 5 (block 1), b at position 3 (block 0's last slot)
    assert a.block_table == [0, 1] and b.block_table == [2]
    run_step(s)  # b's position 4 needs a new block
    assert b.block_table == [2, 3]


def test_waiting_served_ratio_gates_new_prefills() -> None:
    s = make(num_blocks=64, prefill=100, waiting_served_ratio=1.0, max_waiting_tokens=3)
    for rid in "abcd":
        s.add(seq(rid, 2))
    run_step(s)
    assert len(s.running) == 4
    s.add(seq("late", 2))  # 1 waiting < 1.0 x 4 running: decodes go on without it
    assert run_step(s) == [("a", 1), ("b", 1), ("c", 1), ("d", 1)]
    assert run_step(s) == [("a", 1), ("b", 1), ("c", 1), ("d", 1)]
    assert run_step(s) == [("a", 1), ("b", 1), ("c", 1), ("d", 1)]
    # max_waiting_tokens (3) decode steps passed: the late prompt joins now
    assert run_step(s)[-1] == ("late", 2)


def test_max_batch_size() -> None:
    s = make(max_batch_size=2)
    for rid in "abc":
        s.add(seq(rid, 2))
    assert [r for r, _ in run_step(s)] == ["a", "b"]
    assert [q.request_id for q in s.waiting_in_order()] == ["c"]


def test_preempts_youngest_and_requeues_it_first() -> None:
    s = make(num_blocks=3, block_size=4, prefill=100)
    a, b = seq("a", 4), seq("b", 4)
    s.add(a)
    s.add(b)
    s.add(seq("c", 4))
    assert run_step(s) == [("a", 4), ("b", 4), ("c", 4)]
    # every sequence now needs a second block and none is free: a (oldest) takes the block of
    # the youngest, c; then b finds none and preempts itself
    out = s.schedule()
    assert [q.request_id for q in out.preempted] == ["c", "b"]
    assert [q.request_id for q in out.seqs] == ["a"]
    assert a.block_table == [0, 2]
    assert [q.request_id for q in s.waiting_in_order()] == ["b", "c"]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert s.num_preemptions == 2
    # nothing is admitted in a step that preempted
    assert not any(q.request_id in ("b", "c") for q in out.seqs)


def test_preempted_sequence_recomputes_prompt_and_output() -> None:
    s = make(num_blocks=2, block_size=4, prefill=100)
    a, b = seq("a", 4), seq("b", 3)
    s.add(a)
    s.add(b)
    run_step(s)  # a: 4 tokens + 1 sampled, b: 3 + 1
    out = s.schedule()  # a needs block 3rd -> b preempted
    assert [q.request_id for q in out.preempted] == ["b"]
    for q, n in zip(out.seqs, out.num_new_tokens, strict=True):
        q.num_computed_tokens += n
        q.token_ids.append(7)
    s.remove(a)  # a finishes: its blocks come back
    assert run_step(s) == [("b", 4)]  # its 3 prompt tokens and 1 generated token, recomputed


def test_remove_frees_everything() -> None:
    s = make(num_blocks=8)
    a = seq("a", 9)
    s.add(a)
    run_step(s)
    s.remove(a)
    assert s.block_manager.num_free_blocks == 8
    assert not s.has_unfinished()
