"""Prefix caching: hits, copy-on-write, eviction order, collisions, and the allocator invariants."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from loom.engine.block_manager import BlockManager, block_hash
from loom.engine.scheduler import Scheduler, SchedulerConfig
from loom.engine.sequence import Sequence, SequenceStatus
from loom.engine.types import EngineRequest


def seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(EngineRequest(rid, tuple(tokens)), 0, None)


def compute(bm: BlockManager, s: Sequence) -> None:
    """Admit ``s`` on its cached prefix and 'compute' the rest, as the engine would."""
    hits = bm.match_prefix(s)
    bm.use_prefix(s, hits)
    bm.append_slots(s, s.num_tokens - s.num_computed_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.register_full_blocks(s)


def test_second_prompt_reuses_full_blocks_by_refcount() -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a = seq(list(range(10, 20)))  # 10 tokens: blocks [0, 1] full, block 2 partial
    compute(bm, a)
    assert a.block_table == [0, 1, 2]
    b = seq([*range(10, 18), 99, 98])  # shares the first 8 tokens
    assert bm.match_prefix(b) == [0, 1]
    compute(bm, b)
    assert b.block_table == [0, 1, 3]
    assert b.num_cached_tokens == 8
    assert bm.allocator.refcounts[:4] == [2, 2, 1, 1]
    bm.check_invariants([a, b])


def test_whole_prompt_hit_still_computes_the_last_token() -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    compute(bm, seq(list(range(8))))
    again = seq(list(range(8)))
    assert bm.match_prefix(again) == [0]  # block 1 holds the last token: recomputed
    compute(bm, again)
    assert again.block_table == [0, 2]


def test_freed_blocks_stay_cached_until_evicted_in_lru_order() -> None:
    bm = BlockManager(4, 2, enable_prefix_caching=True)
    a = seq([1, 2, 3, 4, 5])  # blocks 0 [1,2], 1 [3,4], 2 [5]
    compute(bm, a)
    bm.free(a)  # back to the free queue tail-first: 3 (never used), 2, 1, 0
    assert bm.num_free_blocks == 4
    b = seq([1, 2, 3, 4, 9])
    assert bm.match_prefix(b) == [0, 1]  # still cached while free
    compute(bm, b)  # takes 0 and 1 back from the free queue, allocates 3 (the oldest free)
    assert b.block_table == [0, 1, 3]
    bm.free(b)
    # the next allocations evict in LRU order: 2 first (freed earliest), then 3, 1, 0
    c = seq([7, 7, 7, 7, 7, 7, 7])
    compute(bm, c)
    assert c.block_table == [2, 3, 1, 0]
    assert bm.stats.evictions == 2  # blocks 1 and 0 were indexed ([3,4] and [1,2]); 2 and 3 never full
    assert bm.match_prefix(seq([1, 2, 3, 4, 5])) == []


def test_hash_collision_never_returns_wrong_kv(monkeypatch: object) -> None:
    import loom.engine.block_manager as mod

    bm = BlockManager(8, 2, enable_prefix_caching=True)
    # Every block hashes the same: a lookup must still compare tokens.
    monkeypatch.setattr(mod, "block_hash", lambda parent, tokens, adapter="": 42)  # type: ignore[attr-defined]
    compute(bm, seq([1, 2, 3]))
    assert bm.match_prefix(seq([5, 6, 7])) == []
    assert bm.match_prefix(seq([1, 2, 9])) == [0]


def test_adapters_never_share() -> None:
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    compute(bm, seq([1, 2, 3]))
    other = seq([1, 2, 3])
    other.adapter_id = "lora-a"
    assert bm.match_prefix(other) == []
    assert block_hash(0, (1, 2), "lora-a") != block_hash(0, (1, 2))


def test_copy_on_write_of_a_shared_partial_block() -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    parent, child = seq(list(range(6))), seq(list(range(6)))
    compute(bm, parent)
    bm.fork(parent, child)
    child.token_ids.append(50)
    bm.append_slots(child, 1)
    assert child.block_table == [0, 2]
    assert bm.take_blocks_to_copy() == [(1, 2)]
    bm.check_invariants([parent, child])


def test_disabled_cache_never_hits() -> None:
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    compute(bm, seq([1, 2, 3]))
    assert bm.match_prefix(seq([1, 2, 3])) == []


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_block_manager_invariants_under_random_scheduling(data: st.DataObject) -> None:
    """Random arrivals (sharing prefixes), steps, finishes and aborts over a small pool:
    refcounts always match the block tables, nothing referenced is free, and nothing leaks."""
    num_blocks = data.draw(st.integers(6, 24))
    bm = BlockManager(num_blocks, 2, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_batch_prefill_tokens=data.draw(st.integers(2, 16)),
                                      enable_chunked_prefill=data.draw(st.booleans())), bm)
    prefixes = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10], [11]]
    live: list[Sequence] = []
    for i in range(data.draw(st.integers(1, 30))):
        action = data.draw(st.sampled_from(["add", "step", "step", "finish"]))
        if action == "add":
            prefix = data.draw(st.sampled_from(prefixes))
            tail = data.draw(st.lists(st.integers(12, 40), max_size=4))
            if len(prefix) + len(tail) + 6 > num_blocks * 2:
                continue  # a request must fit the pool on its own (validation guarantees it)
            s = seq(prefix + tail, f"r{i}")
            live.append(s)
            sched.add(s)
        elif action == "step":
            out = sched.schedule()
            for s, n in zip(out.seqs, out.num_new_tokens, strict=True):
                s.num_computed_tokens += n
                bm.register_full_blocks(s)
                if s.num_computed_tokens == s.num_tokens:
                    s.token_ids.append(random.Random(i).randint(12, 40))
                    if s.num_output_tokens >= 6:
                        sched.remove(s)
        elif live:
            sched.remove(data.draw(st.sampled_from(live)))
        bm.check_invariants(sched.running + sched.waiting)
    for s in live:
        if s.status is not SequenceStatus.FINISHED:
            sched.remove(s)
    assert bm.num_free_blocks == num_blocks
    assert bm.allocator.refcounts == [0] * num_blocks


def test_blocks_scheduled_in_this_step_are_shared_and_forgotten_if_the_step_does_not_run() -> None:
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    a = seq(list(range(10, 23)), "a")  # 13 tokens: 3 full blocks
    bm.use_prefix(a, bm.match_prefix(a))
    bm.append_slots(a, 13)
    bm.register_full_blocks(a, 13)  # scheduled, not computed yet: pending entries
    b = seq([*range(10, 22), 99], "b")
    hits = bm.match_prefix(b)
    assert hits == a.block_table[:3]  # b shares them in the same step
    bm.use_prefix(b, hits)
    assert b.uses_pending_blocks
    bm.drop_pending()  # the step failed: nothing may hit KV that was never written
    assert bm.match_prefix(seq(list(range(10, 23)), "c")) == []
    # Freeing the only holder of a pending block forgets it too (a preempted prefill chunk).
    bm2 = BlockManager(16, 4, enable_prefix_caching=True)
    d = seq(list(range(30, 39)), "d")
    bm2.use_prefix(d, [])
    bm2.append_slots(d, 9)
    bm2.register_full_blocks(d, 9)
    bm2.free(d)
    assert bm2.match_prefix(seq(list(range(30, 39)), "e")) == []
    # Committed (the step ran): they stay cached after the holder is freed.
    f = seq(list(range(30, 39)), "f")
    bm2.use_prefix(f, [])
    bm2.append_slots(f, 9)
    bm2.register_full_blocks(f, 9)
    bm2.commit_pending()
    bm2.free(f)
    assert len(bm2.match_prefix(seq(list(range(30, 39)), "g"))) == 2
