"""The scheduler: decides, every step, which sequences run and how many tokens each computes.

Policy (iteration-level batching, TGI's budget names):

1. Decode first. Every running sequence gets a slot for its next token, oldest first. When the
   pool has no block for one, the youngest running sequence is preempted: its blocks are freed
   and it goes back to the front of the queue to be recomputed later. Requests never fail for
   lack of memory.
2. Then admit waiting prompts in queue order while ``max_batch_prefill_tokens``, the free blocks
   and ``max_batch_size`` allow. With sequences already running, a new prefill joins only when
   enough requests wait (``waiting_served_ratio`` x running) or decodes have gone
   ``max_waiting_tokens`` steps without one, so a trickle of arrivals cannot slow every decode.
   Nothing is admitted in a step that had to preempt.

Prefill and decode rows of one step go into one flattened forward.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_prefill_tokens: int
    max_batch_size: int | None = None
    waiting_served_ratio: float = 0.3
    max_waiting_tokens: int = 20


@dataclass
class SchedulerOutput:
    seqs: list[Sequence]  # sequences with rows in this forward, in row order
    num_new_tokens: list[int]  # rows each contributes (>= 1)
    # completions forked from a parent admitted this step: (child, parent); each samples its
    # first token from the parent's last row with its own seed.
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_prefill_seqs(self) -> int:
        return sum(1 for n in self.num_new_tokens if n > 1)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: oldest first
        self.pending_forks: dict[int, list[Sequence]] = {}  # parent seq_id -> children to fork
        self.steps_since_prefill = 0
        self.num_preemptions = 0

    # -- queue --------------------------------------------------------------------------------
    def add(self, seq: Sequence, children: list[Sequence] | None = None) -> None:
        """Queue a new sequence; ``children`` are further completions sharing its prompt."""
        self.waiting.append(seq)
        if children:
            self.pending_forks[seq.seq_id] = children

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        for child in self.pending_forks.pop(seq.seq_id, []):
            child.status = SequenceStatus.FINISHED
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step decision -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(seqs=[], num_new_tokens=[])
        self._schedule_decodes(out)
        if not out.preempted:
            self._schedule_prefills(out)
        out.blocks_to_copy = self.block_manager.take_blocks_to_copy()
        return out

    def _schedule_decodes(self, out: SchedulerOutput) -> None:
        bm = self.block_manager
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            n = seq.num_uncomputed_tokens
            while not bm.can_append(seq, n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                bm.append_slots(seq, n)
                out.seqs.append(seq)
                out.num_new_tokens.append(n)
                i += 1

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _prefill_allowed(self) -> bool:
        if not self.running:
            return True
        if self.steps_since_prefill >= self.config.max_waiting_tokens:
            return True
        min_size = math.floor(len(self.running) * self.config.waiting_served_ratio)
        return len(self.waiting) >= max(1, min_size)

    def _schedule_prefills(self, out: SchedulerOutput) -> None:
        if not self.waiting or not self._prefill_allowed():
            self.steps_since_prefill += 1
            return
        bm = self.block_manager
        budget = self.config.max_batch_prefill_tokens
        max_seqs = self.config.max_batch_size
        used = 0
        admitted = 0
        while self.waiting:
            seq = self.waiting[0]
            n = seq.num_uncomputed_tokens
            group = 1 + len(self.pending_forks.get(seq.seq_id, ()))
            if used + n > budget and admitted > 0:
                break
            if max_seqs is not None and len(self.running) + group > max_seqs:
                break
            if bm.num_new_blocks_needed(seq, n) > bm.num_free_blocks:
                break  # queue order is kept: a later, smaller prompt does not jump ahead
            self.waiting.popleft()
            bm.append_slots(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            used += n
            admitted += 1
            for child in self.pending_forks.pop(seq.seq_id, []):
                bm.fork(seq, child)
                child.status = SequenceStatus.RUNNING
                self.running.append(child)
                out.forks.append((child, seq))
        self.steps_since_prefill = 0 if admitted else self.steps_since_prefill + 1
