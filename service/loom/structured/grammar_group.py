"""Structured output's matchers split over several grammar processes, which fill a step's rows at once.

Why: with one grammar process (loom.structured.grammar_process) the engine still waits for the
rows on most constrained steps at batch 64 (S1 on the H100: the child's step took 0.22-0.36 ms,
mostly xgrammar's fill of ~54 distinct matcher states, against ~0.12 ms the engine leaves it). Two
processes, each with half of the matchers, fill half of the states each, side by side.

How: :class:`GrammarProcessGroup` has the driver's interface over N
:class:`~loom.structured.grammar_process.GrammarProcess` children. A request goes to one child
for its lifetime: the child its grammar text went to first (its home), unless that child holds
more than a bounded share above the least loaded, then the least loaded. Requests with the same
text thus share a child: its compiled grammar and, for matchers in the same state (identical
requests, completions of one request), one filled row copied to the others (the driver's fast
rows), which two children would each fill. Every child maps the same shared rows (:class:`~loom.structured.shared_rows.SharedRows`):
for each step the group numbers the sampling rows that have a grammar in ascending order (their
slots) and names the half to fill, and each child writes its own rows at their slots. The rows the
sampler gets are then one block, ascending, as from one process: nothing downstream changes, and
there is no copy to merge them. A child with no rows in a step gets no layout (one message fewer).

A child that ends or fails to fill fails its own requests only (as refusals after their token,
:meth:`take_refusals`); its rows are left open for that step, and the other children's requests go on.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence as Seq

import structlog

from loom.engine.sequence import Sequence
from loom.sample.batch import TokenBitmaskRows

from .compiler_pool import CompileStats
from .driver import Refusal
from .grammar_process import ChildStats, GrammarProcess, GrammarProcessError, ProcessConfig, WaitStats
from .shared_rows import SharedRows
from .spec import GrammarSpec

log = structlog.get_logger(__name__)

_HOME_SLACK = 8  # sequences a text's home child may hold above the least loaded before it overflows
_HOMES = 4096  # grammar texts whose home is remembered (most recent)
# A child's share of a step: its sequences (in the step's order), their drafts (None: none), and
# the slot of each of its sampling rows
_Share = tuple[list[Sequence], list[Seq[int]] | None, list[int]]


class GrammarProcessGroup:
    """The driver's interface (:class:`~loom.structured.driver.StructuredOutput`) served by
    ``processes`` grammar processes, each holding a share of the constrained sequences."""

    fills_ahead = True

    def __init__(self, config: ProcessConfig, processes: int, start_timeout_s: float = 120.0,
                 register_rows: bool = False) -> None:
        if processes < 2:
            raise ValueError(f"a group has at least 2 grammar processes; got {processes}")
        self.vocab_size = config.vocab_size
        self.words = -(-config.vocab_size // 32)
        self._rows = SharedRows(self.words, register_rows)
        self.children = [GrammarProcess(config, start_timeout_s, rows=self._rows) for _ in range(processes)]
        self._homes: OrderedDict[tuple[str, str], GrammarProcess] = OrderedDict()  # grammar text -> its child
        self._num_homes = {id(c): 0 for c in self.children}  # texts whose home each child is
        self._matched: dict[int, tuple[Sequence, GrammarProcess]] = {}  # seq_id -> (it, the child with its matcher)
        # the step will_sample was told of: its sequence ids, its rows with a grammar (ascending:
        # row k is at slot k), the half filled, and the children that fill some of them with their shares
        self._step: tuple[list[int], list[int], int, list[tuple[GrammarProcess, _Share]]] | None = None
        self._half = 1  # the half of the rows taken last: the next step fills the other
        self._late: list[Refusal] = []  # requests of a child that failed a fill (take_refusals)
        self.waits = WaitStats()

    # -- requests -------------------------------------------------------------------------------------
    def hold(self, request_id: str, spec: GrammarSpec, seqs: list[Sequence]) -> None:
        """Compile ``spec`` for ``seqs`` in its text's home child while that child's load (its
        constrained sequences, held or matched) is within ``max(8, least / 4)`` of the least
        loaded one's; else in the least loaded (among equals, the home of the fewest texts), which
        becomes the home of a text new here."""
        homes = self._homes
        least = min(self.children, key=lambda c: (c.load, self._num_homes[id(c)]))
        home = homes.get(spec.key)
        if home is not None:
            homes.move_to_end(spec.key)
        if home is None or home.load > least.load + max(_HOME_SLACK, least.load // 4):
            if home is None:
                homes[spec.key] = least
                self._num_homes[id(least)] += 1
                if len(homes) > _HOMES:
                    self._num_homes[id(homes.popitem(last=False)[1])] -= 1
            home = least
        home.hold(request_id, spec, seqs)

    @property
    def num_held(self) -> int:
        return sum(c.num_held for c in self.children)

    @property
    def num_matched(self) -> int:
        return len(self._matched)

    def take_ready(self) -> tuple[list[list[Sequence]], list[Refusal]]:
        self.forget_finished()
        for child in self.children:  # every child's holds first: they compile side by side
            child.flush()
        ready: list[list[Sequence]] = []
        refused: list[Refusal] = []
        for child in self.children:
            r, f = child.take_ready()
            for seqs in r:
                for seq in seqs:
                    self._matched[seq.seq_id] = (seq, child)
            ready += r
            refused += f
        return ready, refused

    def forget_finished(self) -> None:
        for child in self.children:
            child.forget_finished()
        # (the children forgot some, or one started again: the same finished sequences here)
        if len(self._matched) != sum(c.num_matched for c in self.children):
            for sid in [sid for sid, (seq, _) in self._matched.items() if seq.is_finished]:
                del self._matched[sid]

    def has_matcher(self, seq: Sequence) -> bool:
        return seq.seq_id in self._matched

    def compile_stats(self) -> CompileStats:
        """The children's compile statistics, summed (each has its own compilers and cache)."""
        total = CompileStats()
        for child in self.children:
            stats = child.compile_stats()
            for f in dataclasses.fields(CompileStats):
                mine, theirs = getattr(total, f.name), getattr(stats, f.name)
                setattr(total, f.name, [a + b for a, b in zip(mine, theirs, strict=True)] if isinstance(mine, list)
                        else mine + theirs)
        return total

    def close(self) -> None:
        for child in self.children:
            child.close()
        self._rows.release()

    def child_stats(self, timeout: float = 5.0) -> ChildStats | None:
        """The busiest child's :class:`ChildStats` (the engine waits for the slowest fill), or None
        if one does not answer; for diagnostics, between steps."""
        stats = [child.child_stats(timeout) for child in self.children]
        if any(s is None for s in stats):
            return None
        return max((s for s in stats if s is not None), key=lambda s: s.step_s)

    # -- steps ----------------------------------------------------------------------------------------
    def any_matched(self, seqs: Seq[Sequence]) -> bool:
        matched = self._matched
        return bool(matched) and any(seq.seq_id in matched for seq in seqs)

    def will_sample(self, seqs: Seq[Sequence], drafts: Seq[Seq[int]] | None = None) -> None:
        """Number the step's rows with a grammar (their slots, ascending) and give each child that
        fills some its own sequences only, with the slots of their rows."""
        matched = self._matched
        hits = [matched.get(s.seq_id) for s in seqs]
        drafted = drafts is not None and any(drafts)
        rows: list[int] = []  # [G] sampling rows with a grammar, ascending: row k goes to slot k
        shares: dict[int, _Share] = {}  # id(child) -> its share of the step
        if not drafted:  # a row a sequence
            rows = [i for i, hit in enumerate(hits) if hit is not None]
            for child in self.children:
                mine = [(k, i) for k, i in enumerate(rows) if hits[i][1] is child]  # type: ignore[index]
                if mine:
                    shares[id(child)] = ([seqs[i] for _, i in mine], None, [k for k, _ in mine])
        else:  # 1 + len(drafts[i]) rows for sequence i
            assert drafts is not None
            row = 0
            for seq, hit, guess in zip(seqs, hits, drafts, strict=True):
                n = 1 + len(guess)
                if hit is not None:
                    share = shares.get(id(hit[1]))
                    if share is None:
                        share = shares[id(hit[1])] = ([], [], [])
                    share[0].append(seq)
                    share[1].append(guess)  # type: ignore[union-attr]
                    share[2].extend(range(len(rows), len(rows) + n))
                    rows.extend(range(row, row + n))
                row += n
        half = self._half ^ 1
        self._rows.reserve(len(rows))
        fillers = [(c, shares[id(c)]) for c in self.children if id(c) in shares]
        for child, (own, own_drafts, slots) in fillers:
            child.will_sample(own, own_drafts, placement=(slots, half))
        self._step = ([s.seq_id for s in seqs], rows, half, fillers)

    def accept_step(self, items: Seq[tuple[Sequence, Seq[int]]]) -> dict[int, Refusal]:
        """Each child gets its sequences' tokens (and the next step's layout, if it fills rows there)."""
        matched = self._matched
        shares: dict[int, list[tuple[Sequence, Seq[int]]]] = {id(c): [] for c in self.children}
        for seq, tokens in items:
            hit = matched.get(seq.seq_id)
            if hit is not None:
                shares[id(hit[1])].append((seq, tokens))
        refusals: dict[int, Refusal] = {}
        for child in self.children:
            refusals.update(child.accept_step(shares[id(child)]))
        return refusals

    def bitmask_rows(self, seqs: Seq[Sequence], drafts: Seq[Seq[int]] | None = None) -> TokenBitmaskRows | None:
        """The step's rows, once every child that fills some has written them at their slots."""
        step = self._step
        if step is None or step[0] != [s.seq_id for s in seqs]:
            raise GrammarProcessError("the grammar rows asked for are not those of the step launched last")
        self._step = None
        _, rows, half, fillers = step
        if not rows:
            return None
        block = self._rows.views[half]  # [capacity, words]: row k at slot k
        unfilled: list[int] = []  # slots no child wrote (it failed, or lost a matcher): left open
        waited = 0.0
        for child, (own, _, slots) in fillers:
            before = child.waits.wait_s
            try:
                taken = child.take_rows(own)  # (its rows are numbered in its own sampling rows)
            except GrammarProcessError as exc:
                self._fail_child(child, own, exc)
                taken = None
            waited += child.waits.wait_s - before
            if taken is None or len(taken[0]) != len(slots):
                done = set(taken[0]) if taken is not None else set()
                unfilled += [slot for r, slot in enumerate(slots) if r not in done]
        self.waits.add(waited)
        self._half = half
        if unfilled:
            block[unfilled] = -1
        return TokenBitmaskRows(rows, self.words, block[: len(rows)], registered=self._rows.registered)

    def _fail_child(self, child: GrammarProcess, own: Seq[Sequence], exc: Exception) -> None:
        """``child``'s rows of this step (its sequences ``own``) failed: its running requests fail,
        the others go on."""
        refused: dict[str, Refusal] = {}
        for seq in own:
            if not seq.is_finished and (r := child.host_fault(seq, "filling this step's token masks", exc)) is not None:
                refused.setdefault(r.request_id, r)
        log.error("a grammar process failed this step's rows: its constrained requests fail, the others go on",
                  requests=sorted(refused), error=repr(exc))
        self._late.extend(refused.values())

    def await_rows(self) -> None:
        """Nothing to read: the rows :meth:`bitmask_rows` returns are complete (only a single grammar
        process returns them before they are, ``LOOM_GRAMMAR_DEVICE_WAIT``)."""

    def take_refusals(self) -> list[Refusal]:
        out, self._late = self._late, []
        seen = {r.request_id for r in out}
        for child in self.children:
            out += [r for r in child.take_refusals() if r.request_id not in seen]
        return out

    def terminated(self, seq: Sequence) -> bool:
        return seq.seq_id in self._matched

    def host_fault(self, seq: Sequence, doing: str, exc: Exception) -> Refusal | None:
        hit = self._matched.get(seq.seq_id)
        return None if hit is None else hit[1].host_fault(seq, doing, exc)
