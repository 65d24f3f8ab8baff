"""The scheduler: decides, every step, which sequences run and how many tokens each computes.

Policy (iteration-level batching, TGI's budget names), in this order every step:

1. **Decodes.** Every running sequence with one token to compute gets its slot, oldest first.
2. **Running prefills** (chunked prefill): sequences part-way through their prompt get their next
   chunk, oldest first, while ``max_batch_prefill_tokens`` lasts (in a step with decodes, the
   smaller budget of a latency target when one is set: ``--max-step-latency-ms``).
3. **New prompts**, in queue order: priority first (lower value first), then arrival. Each
   starts on its longest cached prefix (prefix caching) and computes the rest, chunked to the
   budget left. Without chunking a prompt joins only whole, and, while sequences run, only when
   enough wait (``waiting_served_ratio`` x running) or decodes went ``max_waiting_tokens`` steps
   without a prefill. Nothing new is admitted in a step that had to preempt.

When a running sequence needs a block and none is free, a victim is preempted: the running
sequence of the worst priority, youngest first. Its blocks are freed (their KV stays in the
prefix cache until reused, so recomputing it is cheap) and it goes back to the queue; requests
never fail for lack of memory. Requests older than ``max_queue_age_s`` rank above every
priority, both for admission and against preemption, so nothing starves.

Prefill chunks and decode rows of one step go into one flattened forward.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_prefill_tokens: int
    max_batch_size: int | None = None
    waiting_served_ratio: float = 0.3
    max_waiting_tokens: int = 20
    enable_chunked_prefill: bool = True
    max_queue_age_s: float = 60.0


@dataclass
class SchedulerOutput:
    seqs: list[Sequence]  # sequences with rows in this forward, in row order
    num_new_tokens: list[int]  # rows each contributes (>= 1)
    # completions forked from a parent whose prompt completes this step: (child, parent); each
    # samples its first token from the parent's last row with its own seed.
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


@dataclass
class SchedulerCounters:
    preemptions: int = 0
    prefill_chunks: int = 0  # prefill pieces that did not finish their prompt
    steps_with_prefill: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.block_manager = block_manager
        self.clock = clock
        self.waiting: list[Sequence] = []  # kept sorted by _queue_key at schedule time
        self.running: list[Sequence] = []  # admission order: oldest first
        self.pending_forks: dict[int, list[Sequence]] = {}  # parent seq_id -> children to fork
        self.steps_since_prefill = 0
        self.counters = SchedulerCounters()
        # --max-step-latency-ms (engine/step_latency.py): the prompt tokens a step that carries
        # this many decode rows may prefill; None: max_batch_prefill_tokens for every step.
        self.prefill_budget_with_decodes: Callable[[int], int] | None = None

    @property
    def num_preemptions(self) -> int:
        return self.counters.preemptions

    # -- queue --------------------------------------------------------------------------------
    def add(self, seq: Sequence, children: list[Sequence] | None = None) -> None:
        """Queue a new sequence; ``children`` are further completions sharing its prompt."""
        self.waiting.append(seq)
        if children:
            self.pending_forks[seq.seq_id] = children

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks."""
        if seq.status is SequenceStatus.RUNNING and seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        for child in self.pending_forks.pop(seq.seq_id, []):
            child.status = SequenceStatus.FINISHED
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def waiting_in_order(self) -> list[Sequence]:
        """The queue in the order it will be served."""
        now = self.clock()
        return sorted(self.waiting, key=lambda s: self._queue_key(s, now))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _rank(self, seq: Sequence, now: float) -> float:
        """Effective priority: lower is more important; old requests outrank every priority."""
        if now - seq.arrival_time > self.config.max_queue_age_s:
            return -math.inf
        return float(seq.priority)

    def _queue_key(self, seq: Sequence, now: float) -> tuple[float, float, int]:
        return (self._rank(seq, now), seq.arrival_time, seq.seq_id)

    # -- the step decision -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        out = SchedulerOutput(seqs=[], num_new_tokens=[])
        budget = self.config.max_batch_prefill_tokens
        decodes, chunks = self._running_work()
        budget = self._schedule_running(out, now, budget, decodes, is_decode=True)
        if out.seqs and self.prefill_budget_with_decodes is not None:  # streams wait on this step
            budget = min(budget, self.prefill_budget_with_decodes(len(out.seqs)))
        if self.config.enable_chunked_prefill:
            budget = self._schedule_running(out, now, budget, chunks, is_decode=False)
        if not out.preempted:
            self._schedule_waiting(out, now, budget)
        out.blocks_to_copy = self.block_manager.take_blocks_to_copy()
        return out

    def _running_work(self) -> tuple[list[Sequence], list[Sequence]]:
        """Running sequences with work this step, in admission order, split into decodes (one
        token to compute after the first output) and prompts part-way through (chunked prefill)."""
        decodes: list[Sequence] = []
        chunks: list[Sequence] = []
        for seq in self.running:
            left = len(seq.token_ids) - seq.num_computed_tokens
            if left == 0:
                continue  # a forked child waiting for its parent's prompt
            if seq.num_pending_tokens and seq.length_exhausted:
                continue  # the step in flight samples its last token
            if left == 1 and len(seq.token_ids) > seq.num_prompt_tokens:
                decodes.append(seq)
            else:
                chunks.append(seq)
        return decodes, chunks

    def _schedule_running(self, out: SchedulerOutput, now: float, budget: int, seqs: list[Sequence],
                          is_decode: bool) -> int:
        bm = self.block_manager
        for seq in seqs:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            n = 1 if is_decode else min(seq.num_uncomputed_tokens, budget)
            if n <= 0:
                break
            if is_decode and bm.decode_fits(seq):  # the common case: room in its last block
                self._add_rows(out, seq, 1)
                continue
            while not bm.can_append(seq, n):
                victim = self._pick_victim(now)
                if victim is None or (not is_decode and victim is seq):
                    n = 0  # a prefill chunk waits rather than evict itself
                    break
                self._preempt(victim, out)
                if victim is seq:
                    n = 0
                    break
            if n == 0:
                continue
            bm.append_slots(seq, n)
            self._add_rows(out, seq, n)
            if not is_decode:
                budget -= n
        return budget

    def _add_rows(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        out.seqs.append(seq)
        out.num_new_tokens.append(n)
        # Index the blocks this step fills now, so prompts admitted below share them already.
        self.block_manager.register_full_blocks(seq, n)
        if seq.num_computed_tokens + n < seq.num_tokens:
            self.counters.prefill_chunks += 1
        elif seq.seq_id in self.pending_forks and seq.num_output_tokens == 0:
            # The prompt completes in this step: its other completions fork from it now.
            for child in self.pending_forks.pop(seq.seq_id):
                self.block_manager.fork(seq, child)
                child.status = SequenceStatus.RUNNING
                self.running.append(child)
                out.forks.append((child, seq))

    def _pick_victim(self, now: float) -> Sequence | None:
        """The running sequence to preempt: worst priority, then youngest."""
        candidates = [s for s in self.running if s.status is SequenceStatus.RUNNING]
        if not candidates:
            return None
        return max(candidates, key=lambda s: (self._rank(s, now), s.arrival_time, s.seq_id))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        if seq in out.seqs:  # already given rows this step: take them back
            i = out.seqs.index(seq)
            del out.seqs[i], out.num_new_tokens[i]
        self.requeue(seq)
        self.counters.preemptions += 1
        out.preempted.append(seq)

    def requeue(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and queue it to be recomputed."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.append(seq)

    def _prefill_allowed(self) -> bool:
        if self.config.enable_chunked_prefill or not self.running:
            return True
        if self.steps_since_prefill >= self.config.max_waiting_tokens:
            return True
        min_size = math.floor(len(self.running) * self.config.waiting_served_ratio)
        return len(self.waiting) >= max(1, min_size)

    def _schedule_waiting(self, out: SchedulerOutput, now: float, budget: int) -> None:
        if not self.waiting or not self._prefill_allowed():
            self.steps_since_prefill += 1
            return
        self.waiting.sort(key=lambda s: self._queue_key(s, now))
        bm = self.block_manager
        chunked = self.config.enable_chunked_prefill
        max_seqs = self.config.max_batch_size
        admitted = 0
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            group = 1 + len(self.pending_forks.get(seq.seq_id, ()))
            if max_seqs is not None and len(self.running) + group > max_seqs:
                break
            # Prompt logprobs need every prompt row computed, so such requests skip the cache.
            hits = [] if seq.sampling.prompt_logprobs and not seq.prompt_logprobs_sent else bm.match_prefix(seq)
            left = seq.num_tokens - len(hits) * bm.block_size
            n = min(left, budget) if chunked else left
            if not chunked and n > budget and admitted > 0:
                break
            if bm.num_blocks_needed_with_prefix(seq, hits, n) > bm.num_free_blocks:
                break  # queue order is kept: a later, smaller prompt does not jump ahead
            self.waiting.pop(0)
            if seq.num_preemptions == 0:
                bm.record_query(seq.num_tokens, len(hits) * bm.block_size)
            bm.use_prefix(seq, hits)
            bm.append_slots(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add_rows(out, seq, n)
            budget -= n
            admitted += 1
        if admitted:
            self.steps_since_prefill = 0
            self.counters.steps_with_prefill += 1
        else:
            self.steps_since_prefill += 1
