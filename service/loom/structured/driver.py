"""The engine's side of structured output: requests wait for their grammar, matchers follow tokens.

The engine talks to one :class:`StructuredOutput` at four points, and nowhere else:

1. :meth:`~StructuredOutput.hold` when a constrained request arrives: its compile starts on a
   worker thread and its sequences wait here, outside the scheduler, so the batch never waits
   for a grammar;
2. :meth:`~StructuredOutput.take_ready` at the start of each step: requests whose grammar is
   compiled join the scheduler (one matcher per completion), those whose grammar failed or ran
   past ``--grammar-compile-timeout`` are refused;
3. :meth:`~StructuredOutput.bitmask_rows` as the step is planned: the bitmask rows of the
   sampled rows that have a matcher (draft rows too), plain data in the step plan that the
   worker turns into one logits processor (:class:`loom.sample.processors.TokenBitmask`);
4. :meth:`~StructuredOutput.accept_tokens` for the tokens read back (the output processor): the
   matcher advances; when it has matched a whole sentence and its EOS, the completion ends
   (FINISH_REASON_EOS_TOKEN).

A constrained sequence needs its last token on the host before its next mask can be filled. The
engine therefore queues a constrained step's forward first, then reads the previous step's
tokens back (the matchers accept them), then fills this step's rows and queues its sampling: the
host's work overlaps the forward, and asynchronous scheduling stays on. (With tensor
parallelism every rank samples: the rows follow the forward to every rank as a second command.)

``min_new_tokens`` for a constrained row is applied here, on its mask, rather than by the
sampler's EOS suppression: EOS and stop ids are cleared from the row until then, unless the
grammar allows nothing else (a complete match that cannot grow), where the grammar wins.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog
import torch

from loom import kernel_switches
from loom.engine.sequence import Sequence
from loom.engine.types import Rejection
from loom.sample.batch import TokenBitmaskRows

from .compiler_pool import CompileStats, GrammarCompilerPool
from .grammars import GrammarError
from .spec import GrammarSpec
from .vocabulary import VocabularyError

if TYPE_CHECKING:
    import xgrammar

log = structlog.get_logger(__name__)


@dataclass
class _Held:
    spec: GrammarSpec
    future: Future[xgrammar.CompiledGrammar]
    seqs: list[Sequence]
    arrived: float


@dataclass
class _Matched:
    seq: Sequence
    matcher: xgrammar.GrammarMatcher
    field: str  # the request field of its constraint
    handle: Any  # matcher._handle, xgrammar's object: its batch calls take these
    state: int  # the id of its (grammar, accepted tokens): matchers with the same id fill the same mask
    holds_back_stops: bool  # min_new_tokens > 0: EOS and stop ids may need clearing from its rows
    terminated: bool = False  # matcher.is_terminated(), kept by every accept (only a stop token changes it)
    # Tokens in its state id that its own matcher has not accepted yet: a matcher in the same state
    # accepted them for it (the same state and token give the same state), so while matchers keep
    # in step one accepts for all; the matcher catches up when it is needed alone (_sync).
    pending: list[int] = dataclasses.field(default_factory=list)
    # Tokens its own matcher has accepted (xgrammar keeps them all: its history, which a rollback
    # past raises on). After a batch accept raised, this tells whether xgrammar's loop had reached
    # this matcher before it stopped (_took).
    taken: int = 0


# (state id, token) -> state id entries, and grammar texts' start states, kept for sharing masks;
# past this many a map starts again (ids are never reused, so a cleared map only stops matchers
# from meeting again; the texts are not held without bound).
_MAX_STATE_STEPS = 1 << 16
_MAX_ROOTS = 1 << 10

# A row's matcher entry by its row in the bitmask: a list when rows are 0..G-1, a dict when they
# are placed at a group's slots (:meth:`StructuredOutput._fast_rows`)
_ByRow = Seq[_Matched] | dict[int, _Matched]
# (rows shared by a group's grammar processes [capacity, ceil(V / 32)] int32, the slot there of
# each of the step's sampling rows): where bitmask_rows writes
Placement = tuple[torch.Tensor, list[int]]


@dataclass(frozen=True)
class Refusal:
    """A request refused (its grammar did not compile, or a matcher could not follow a token):
    the engine fails it with this message and rejection."""

    request_id: str
    message: str
    rejection: Rejection


class StructuredOutput:
    def __init__(self, pool: GrammarCompilerPool, vocab_size: int, eos_token_ids: tuple[int, ...],
                 compile_timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 fast_rows: bool | None = None) -> None:
        self.pool = pool
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)  # int32 words per bitmask row
        self.eos_token_ids = eos_token_ids
        self.compile_timeout_s = compile_timeout_s
        self.clock = clock
        self._held: dict[str, _Held] = {}
        self._ready_since: float | None = None  # when the pool was first seen ready (self.clock)
        self._matchers: dict[int, _Matched] = {}  # seq_id -> its matcher
        self._dead_ends: dict[int, str] = {}  # seq_id -> why no token could follow
        # seq_id -> why its matcher is out of step (it refused a token that a matcher in its state
        # accepted: a fault of ours or xgrammar's) or broken (xgrammar raised while filling its
        # rows or accepting its token: _raised). Its rows are left open and its next accept fails
        # that request alone, as a refused token does; the batch goes on.
        self._faults: dict[int, str] = {}
        self._bitmask = torch.empty(0, self.words, dtype=torch.int32)  # host rows, grown on demand
        self._batcher: xgrammar.BatchGrammarMatcher | None = None  # fills many rows on its threads
        # The fast path (LOOM_GRAMMAR_FAST_ROWS, on by default): see _fast_rows and _fast_accept.
        self.fast_rows = kernel_switches.grammar_fast_rows if fast_rows is None else fast_rows
        self._stops = frozenset(eos_token_ids)  # the matchers' stop tokens: the only ones that terminate
        # Matcher states by identity: a matcher's state is a function of its grammar's text and the
        # tokens it accepted, so matchers with one id fill one mask. Roots per (kind, text).
        self._roots: dict[tuple[str, str], int] = {}
        self._state_steps: dict[tuple[int, int], int] = {}  # (state id, token) -> state id after it
        self._num_states = 0
        # [rows, ceil(V / 32)] int32 host rows, two used in turn: a step's rows are handed to the
        # worker without a copy, and stay untouched while the next step's are filled
        self._buffers = [torch.empty(0, self.words, dtype=torch.int32) for _ in range(2)]
        self._turn = 0

    # The engine's side of the interface that :class:`~loom.structured.grammar_process.GrammarProcess`
    # shares: here the rows are filled when asked for, so the engine queues a step's sampling as soon
    # as its rows are filled, and a refused token is known when it is accepted.
    fills_ahead = False

    def will_sample(self, seqs: Seq[Sequence], drafts: Seq[Seq[int]] | None = None) -> None:
        """The next :meth:`bitmask_rows` call's rows (the step just launched): nothing to do here."""

    def await_rows(self) -> None:
        """Nothing to read: the rows :meth:`bitmask_rows` returns are complete (only a single grammar
        process returns them before they are, ``LOOM_GRAMMAR_DEVICE_WAIT``)."""

    def take_refusals(self) -> list[Refusal]:
        """Refusals found after their token was used: never here (every accept answers at once)."""
        return []

    def compile_stats(self) -> CompileStats:
        return self.pool.snapshot()

    def close(self) -> None:
        """Nothing to stop: the pool's threads are daemons."""

    # -- requests -----------------------------------------------------------------------------------
    def hold(self, request_id: str, spec: GrammarSpec, seqs: list[Sequence]) -> None:
        """Start compiling ``spec`` for ``seqs`` (all completions of one request) and keep them."""
        self._held[request_id] = _Held(spec, self.pool.compile(spec), seqs, self.clock())

    @property
    def num_held(self) -> int:
        return len(self._held)

    def take_ready(self) -> tuple[list[list[Sequence]], list[Refusal]]:
        """Requests whose grammar is ready (their sequences, each now with a matcher) and requests
        refused; held requests aborted meanwhile are dropped. Also forgets finished sequences."""
        self.forget_finished()
        ready: list[list[Sequence]] = []
        refused: list[Refusal] = []
        for request_id, held in list(self._held.items()):
            if all(s.is_finished for s in held.seqs):  # aborted while its grammar compiled
                del self._held[request_id]
            elif held.future.done():
                del self._held[request_id]
                error = held.future.exception()
                if error is None:
                    self._attach(held.seqs, held.future.result(), held.spec)
                    ready.append(held.seqs)
                else:
                    refused.append(self._refusal(request_id, held.spec, error))
            elif self._past_time_limit(held):
                del self._held[request_id]
                self.pool.mark_timed_out(held.spec)
                refused.append(Refusal(request_id, (
                    f"the constraint did not compile within --grammar-compile-timeout "
                    f"({self.compile_timeout_s:g} s); simplify it (fewer optional properties, smaller "
                    "repetition bounds) or ask the operator for a longer limit"),
                    Rejection("INVALID_ARGUMENT", held.spec.field, "GRAMMAR_COMPILE_TIMEOUT")))
        return ready, refused

    def _past_time_limit(self, held: _Held) -> bool:
        if self.pool.timed_out(held.spec):
            return True  # the same text already ran past the limit and is still compiling
        if self._ready_since is None:
            if self.pool.ready_at is None:
                return False  # the one-time vocabulary description is not counted
            self._ready_since = self.clock()  # (seen at the first look after it: within a step)
        return self.clock() - max(held.arrived, self._ready_since) > self.compile_timeout_s

    @staticmethod
    def _refusal(request_id: str, spec: GrammarSpec, error: BaseException) -> Refusal:
        if isinstance(error, VocabularyError):
            return Refusal(request_id, f"structured output is not available for this model: {error}",
                           Rejection("FAILED_PRECONDITION", spec.field, "GRAMMAR_VOCABULARY"))
        if isinstance(error, GrammarError):
            return Refusal(request_id, f"the constraint does not compile: {error}",
                           Rejection("INVALID_ARGUMENT", spec.field, "GRAMMAR_INVALID"))
        return Refusal(request_id, f"compiling the constraint failed: {type(error).__name__}: {error}",
                       Rejection("INTERNAL", spec.field, "GRAMMAR_COMPILE_FAILED"))

    def _attach(self, seqs: list[Sequence], compiled: xgrammar.CompiledGrammar, spec: GrammarSpec) -> None:
        import xgrammar as xg

        kind, text, field = spec.kind, spec.text, spec.field
        root = self._roots.get((kind, text))
        if root is None:
            if len(self._roots) >= _MAX_ROOTS:
                self._roots.clear()
            root = self._roots[(kind, text)] = self._new_state()
        for seq in seqs:  # one matcher per completion: each follows its own tokens
            matcher = xg.GrammarMatcher(compiled, override_stop_tokens=list(self.eos_token_ids))
            self._matchers[seq.seq_id] = _Matched(seq, matcher, field, matcher._handle, root,
                                                  seq.stopping.min_new_tokens > 0)

    def _new_state(self) -> int:
        self._num_states += 1
        return self._num_states

    def _accepted(self, entry: _Matched, token: int) -> None:
        """``entry``'s matcher has accepted ``token``: its state id and terminated flag follow."""
        entry.taken += 1
        key = (entry.state, token)
        state = self._state_steps.get(key)
        if state is None:
            if len(self._state_steps) >= _MAX_STATE_STEPS:
                self._state_steps.clear()
            state = self._state_steps[key] = self._new_state()
        entry.state = state
        if token in self._stops:
            entry.terminated = entry.matcher.is_terminated()

    @property
    def num_matched(self) -> int:
        """Sequences that have a matcher (finished ones until the next :meth:`forget_finished`)."""
        return len(self._matchers)

    def forget_finished(self) -> None:
        """Drop the matchers of finished sequences (the engine calls this at every step start
        while any are held, so a server whose constrained traffic stops keeps none)."""
        if not self._matchers:
            return
        done = [sid for sid, m in self._matchers.items() if m.seq.is_finished]
        for sid in done:
            del self._matchers[sid]
            self._dead_ends.pop(sid, None)
            self._faults.pop(sid, None)

    # -- steps --------------------------------------------------------------------------------------
    def any_matched(self, seqs: Seq[Sequence]) -> bool:
        """Whether some of ``seqs`` follows a grammar (a step without one pays nothing)."""
        matchers = self._matchers
        return bool(matchers) and any(seq.seq_id in matchers for seq in seqs)

    def bitmask_rows(self, seqs: Seq[Sequence], drafts: Seq[Seq[int]] | None = None,
                     into: Placement | None = None) -> TokenBitmaskRows | None:
        """The step's grammar rows for its sampled sequences ``seqs`` (plan order; sequence i has
        1 + len(drafts[i]) sampling rows), or None when none has a matcher: unconstrained steps pay
        nothing. Rows are filled on the host. A sequence verifying drafts gets a mask per row: its
        matcher walks the drafts (row k is the mask after drafts[:k]) and is rolled back after; rows
        past a draft the grammar refuses are left open, since verification stops at that draft.
        A first row whose grammar allows no token at all is left open and its sequence marked, for
        :meth:`accept` to refuse.

        The rows may be filled after the step was launched (the engine fills them while the
        forward runs): a sequence's tokens then end with the placeholder of the token these rows
        choose, and a sequence the previous step finished (its row is dropped) gets open rows.

        ``into`` (a grammar process of a group, loom.structured.grammar_group): (rows shared with
        the group's other processes, the slot there of each sampling row): each row is written at
        its slot instead of from row 0."""
        if self.fast_rows and (drafts is None or not any(drafts)):
            return self._fast_rows(seqs, into)
        rows = self._plain_rows(seqs, drafts)
        return rows if into is None or rows is None else self._placed(rows, into)

    def _placed(self, filled: TokenBitmaskRows, into: Placement) -> TokenBitmaskRows:
        """``filled`` (rows from 0) copied to their slots in ``into``'s rows."""
        out, slots = into
        out[[slots[row] for row in filled.rows]] = filled.tensor()
        return TokenBitmaskRows(filled.rows, self.words, out)

    def _plain_rows(self, seqs: Seq[Sequence], drafts: Seq[Seq[int]] | None) -> TokenBitmaskRows | None:
        """:meth:`bitmask_rows` row by row (drafts, or the fast path switched off)."""
        rows: list[int] = []
        entries: list[tuple[Sequence, Seq[int]]] = []
        row = 0
        for i, seq in enumerate(seqs):
            guess = drafts[i] if drafts is not None else ()
            if seq.seq_id in self._matchers:
                rows.extend(range(row, row + 1 + len(guess)))
                entries.append((seq, guess))
            row += 1 + len(guess)
        if not rows:
            return None
        if self._bitmask.shape[0] < len(rows):
            self._bitmask = torch.empty(max(len(rows), 2 * self._bitmask.shape[0]), self.words, dtype=torch.int32)
        bitmask = self._bitmask[: len(rows)]  # [G, ceil(V / 32)]
        first_rows: list[tuple[int, Sequence]] = []
        # Rows without drafts are filled in one call (xgrammar's loop in C++: 64 rows in ~65 us
        # on one core, against ~100 us for a Python loop of single fills).
        batch_matchers: list[xgrammar.GrammarMatcher] = []
        batch_rows: list[int] = []
        batch_entries: list[_Matched] = []
        j = 0
        for seq, guess in entries:
            entry = self._matchers[seq.seq_id]
            start, j = j, j + 1 + len(guess)  # its rows: bitmask[start:j]
            matcher = self._sync(entry)
            if matcher is None or seq.is_finished or matcher.is_terminated():  # None: out of step
                bitmask[start:j].fill_(-1)
                continue
            first_rows.append((start, seq))
            if not guess:
                batch_matchers.append(matcher)
                batch_rows.append(start)
                batch_entries.append(entry)
                continue
            done = seq.num_known_tokens - seq.num_prompt_tokens  # output tokens before this step's
            walked = 0
            try:
                for k in range(1 + len(guess)):
                    if k and walked == k - 1 and not matcher.is_terminated() and matcher.accept_token(guess[k - 1]):
                        walked += 1
                    if walked == k:
                        matcher.fill_next_token_bitmask(bitmask, start + k)
                        if done + k < seq.stopping.min_new_tokens:
                            self._hold_back_stops(bitmask[start + k], seq)
                    else:
                        bitmask[start + k].fill_(-1)
                if walked:
                    matcher.rollback(walked)
            except Exception as exc:  # its rows open; its next accept fails its request alone
                self._raised(entry, exc, f"walking its {len(guess)} draft tokens")
                bitmask[start:j].fill_(-1)
        if batch_matchers:
            try:
                self._batch_matcher().batch_fill_next_token_bitmask(batch_matchers, bitmask, batch_rows)
            except Exception:  # some matcher's fill raised: row by row, to find it and fill the others
                for g, entry in zip(batch_rows, batch_entries, strict=True):
                    if not self._fill_alone(entry, bitmask, g):
                        bitmask[g].fill_(-1)
            faults = self._faults
            for g, entry in zip(batch_rows, batch_entries, strict=True):
                seq = entry.seq
                if (seq.num_known_tokens - seq.num_prompt_tokens < seq.stopping.min_new_tokens
                        and not (faults and seq.seq_id in faults)):
                    self._hold_back_stops(bitmask[g], seq)
        empty = (bitmask == 0).all(dim=1).tolist()  # one pass: rows that allow no token
        for g, seq in first_rows:
            if empty[g]:
                self._dead_ends[seq.seq_id] = (
                    f"no token of the model's vocabulary continues the constraint after "
                    f"{seq.num_known_tokens - seq.num_prompt_tokens} generated tokens")
                bitmask[g].fill_(-1)  # sample anything: the token is refused in accept()
        for g in range(len(rows)):
            if empty[g]:
                bitmask[g].fill_(-1)
        return TokenBitmaskRows(rows, self.words, bitmask.numpy().tobytes())

    def _fast_rows(self, seqs: Seq[Sequence], into: Placement | None = None) -> TokenBitmaskRows | None:
        """:meth:`bitmask_rows` without drafts, filling what the plain path fills with less work:

        - one batch fill over the rows' xgrammar handles, and only one row per matcher state: rows
          whose matchers share a state id (the same grammar text and the same accepted tokens,
          e.g. the completions of a request before they diverge, or identical requests) are
          copies of the first (a matcher's mask is a function of its state);
        - a finished matcher is known from the flag its accepts keep (no query per row);
        - min_new_tokens is looked at only for sequences that have one;
        - the empty-row check is one numpy pass; the rows are handed over as the driver's own
          tensor (:class:`TokenBitmaskRows`), not copied to bytes.

        With ``into``, row g (entry g) is written at its slot there rather than at g: the work is
        done in the rows' own numbering (``at``, and ``by_row`` for the entry of a row).
        """
        matchers = self._matchers
        rows: list[int] = []
        entries: list[_Matched] = []
        for i, seq in enumerate(seqs):
            entry = matchers.get(seq.seq_id)
            if entry is not None:
                rows.append(i)
                entries.append(entry)
        if not rows:
            return None
        at: Seq[int]
        by_row: _ByRow
        if into is None:
            bitmask = self._rows_buffer(len(rows))  # [G, ceil(V / 32)]
            at, by_row = range(len(rows)), entries
        else:
            bitmask = into[0]  # [capacity, ceil(V / 32)]: the group's half
            at = [into[1][i] for i in rows]
            by_row = dict(zip(at, entries, strict=True))
        every = into is None  # the rows are the whole of bitmask, in order
        handles: list[Any] = []
        filled: list[int] = []  # bitmask rows xgrammar fills
        copies: list[tuple[int, int]] = []  # (row, the filled row of the same state)
        first_of: dict[int, int] = {}  # state id -> its filled row
        holds: list[int] = []  # filled or copied rows whose sequence has a min_new_tokens
        ended: list[int] = []  # rows of finished sequences and terminated matchers: left open
        for g, entry in zip(at, entries, strict=True):
            if entry.terminated or entry.seq.is_finished:
                ended.append(g)
                continue
            src = first_of.setdefault(entry.state, g)
            if src == g:
                if self._sync(entry) is None:  # out of step: its row open, the state's next row fills
                    del first_of[entry.state]
                    ended.append(g)
                    continue
                handles.append(entry.handle)
                filled.append(g)
            else:
                copies.append((g, src))
            if entry.holds_back_stops:
                holds.append(g)
        if handles:  # xgrammar's own object: its wrapper would build the handle list again
            batcher: Any = self._batch_matcher()._handle
            try:
                batcher.batch_fill_next_token_bitmask(handles, bitmask,
                                                      None if every and len(filled) == len(rows) else filled, False)
            except Exception:  # some matcher's fill raised: row by row, to find it and fill the others
                filled, copies = self._fill_rows_alone(by_row, bitmask, filled, copies, ended)
                holds = [g for g in holds if by_row[g].seq.seq_id not in self._faults]
        words = bitmask.numpy()  # the same memory
        # Rows that allow no token (rare): only a filled row can be one (a copy is as empty as its
        # source, an open row is all ones, and clearing stop ids never empties a row: see
        # _hold_back_stops), so the check reads the filled rows only, before the copies.
        if filled:
            allows = words.any(axis=1) if every and len(filled) == len(rows) else words[filled].any(axis=1)
            empty = {filled[k] for k in np.flatnonzero(~allows).tolist()}
        else:
            empty = set()
        if copies:  # one gather for all of them (a row assignment each cost ~1 us)
            words[[g for g, _ in copies]] = words[[src for _, src in copies]]
        if ended:
            words[ended] = -1
        for g in holds:
            seq = by_row[g].seq
            if seq.num_known_tokens - seq.num_prompt_tokens < seq.stopping.min_new_tokens:
                self._hold_back_stops(bitmask[g], seq)
        if empty:
            self._mark_dead_ends(words, by_row, sorted([*empty, *(g for g, src in copies if src in empty)]))
        return TokenBitmaskRows(rows, self.words, bitmask)  # (with ``into``: its rows whole, ours at their slots)

    def _fill_rows_alone(self, entries: _ByRow, bitmask: torch.Tensor, filled: list[int],
                         copies: list[tuple[int, int]], ended: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
        """:meth:`_fast_rows` after its batch fill raised: each of its rows filled alone. A matcher
        whose own fill raises is a fault (:meth:`_raised`): its row is left open (added to
        ``ended``) and the next row of its state, caught up, fills in its place for the copies.
        Returns the rows filled and the copies left (row, the filled row of the same state)."""
        copies_of: dict[int, list[int]] = {}
        for g, first in copies:
            copies_of.setdefault(first, []).append(g)
        now_filled: list[int] = []
        now_copies: list[tuple[int, int]] = []
        for g in filled:
            src: int | None = None  # the row of this state filled alone
            for row in (g, *copies_of.get(g, ())):
                if src is not None:
                    now_copies.append((row, src))
                elif (row == g or self._sync(entries[row]) is not None) and self._fill_alone(entries[row], bitmask, row):
                    src = row
                    now_filled.append(row)
                else:  # a fault (its matcher raised, or is out of step): open
                    ended.append(row)
        return now_filled, now_copies

    def _fill_alone(self, entry: _Matched, bitmask: torch.Tensor, g: int) -> bool:
        """Fill row ``g`` from ``entry``'s matcher alone; False (a fault, recorded) when it raises."""
        try:
            entry.matcher.fill_next_token_bitmask(bitmask, g)
        except Exception as exc:
            self._raised(entry, exc, "filling its mask")
            return False
        return True

    def _mark_dead_ends(self, words: np.ndarray, entries: _ByRow, empty: list[int]) -> None:
        for g in empty:
            seq = entries[g].seq
            self._dead_ends[seq.seq_id] = (
                f"no token of the model's vocabulary continues the constraint after "
                f"{seq.num_known_tokens - seq.num_prompt_tokens} generated tokens")
            words[g] = -1  # sample anything: the token is refused in accept()

    def _rows_buffer(self, n: int) -> torch.Tensor:
        """[n, ceil(V / 32)] int32 host rows: the other of the two buffers than last step's."""
        self._turn ^= 1
        buf = self._buffers[self._turn]
        if buf.shape[0] < n:
            buf = self._buffers[self._turn] = torch.empty(max(n, 2 * buf.shape[0]), self.words, dtype=torch.int32)
        return buf[:n]

    def _batch_matcher(self) -> xgrammar.BatchGrammarMatcher:
        if self._batcher is None:
            import xgrammar as xg

            # One thread: the loop in C++ without a Python call a row. xgrammar's thread pool
            # cost more than it saved at these sizes: 64 rows of S1's schemas took 63-69 us on
            # one thread and 571-697 us on two on this project's VM, and a profile on the H200
            # (8 threads, its default there) measured 0.55 ms a step.
            self._batcher = xg.BatchGrammarMatcher(max_threads=1)
        return self._batcher

    def _hold_back_stops(self, row: torch.Tensor, seq: Sequence) -> None:
        """Clear EOS and stop ids from ``row`` before min_new_tokens, unless nothing else is allowed."""
        stops = [t for t in (*self.eos_token_ids, *seq.stopping.stop_token_ids) if 0 <= t < self.vocab_size]
        saved = row.clone()
        for t in stops:
            row[t // 32] &= ~(1 << (t % 32)) if t % 32 != 31 else 0x7FFFFFFF
        if not bool(row.any()):
            row.copy_(saved)  # the grammar can only end here: it wins over min_new_tokens

    def accept(self, seq: Sequence, token: int) -> Refusal | None:
        """Advance ``seq``'s matcher by ``token``; why the request must fail, or None."""
        entry = self._matchers.get(seq.seq_id)
        if entry is None:
            return None
        dead_end = self._dead_ends.pop(seq.seq_id, None)
        if dead_end is not None:  # the vocabulary cannot spell what the grammar needs next
            return self._dead_end(seq, entry, dead_end)
        matcher = self._sync(entry)
        if matcher is None:
            return self._fault(seq, entry)
        try:
            accepted = matcher.accept_token(token)
        except Exception as exc:
            self._raised(entry, exc, f"accepting token {token}")
            return self._fault(seq, entry)
        if not accepted:  # the mask allowed it: a fault of ours
            return Refusal(seq.request_id, f"token {token} does not match the constraint after "
                           f"{seq.num_output_tokens - 1} generated tokens",
                           Rejection("INTERNAL", entry.field, "GRAMMAR_TOKEN_REJECTED"))
        self._accepted(entry, token)
        return None

    @staticmethod
    def _dead_end(seq: Sequence, entry: _Matched, why: str) -> Refusal:
        return Refusal(seq.request_id, why, Rejection("FAILED_PRECONDITION", entry.field, "GRAMMAR_DEAD_END"))

    def pending_refusal(self, seq: Sequence) -> Refusal | None:
        """The refusal ``seq``'s next accept gives whatever its token, known once its rows are
        filled: no token could continue its grammar (a dead end), or its matcher is out of step or
        raised (its rows were left open). None otherwise. Nothing changes."""
        entry = self._matchers.get(seq.seq_id)
        if entry is None:
            return None
        dead_end = self._dead_ends.get(seq.seq_id)
        if dead_end is not None:
            return self._dead_end(seq, entry, dead_end)
        if seq.seq_id in self._faults:
            return self._fault(seq, entry)
        return None

    @property
    def has_pending_refusals(self) -> bool:
        """Whether some sequence's next accept is refused in advance (:meth:`pending_refusal`)."""
        return bool(self._dead_ends or self._faults)

    def accept_tokens(self, seq: Sequence, tokens: Seq[int]) -> Refusal | None:
        """:meth:`accept` for a step's tokens of ``seq`` in order (accepted drafts, then the token
        after them), up to the EOS that terminates its grammar."""
        for token in tokens:
            refusal = self.accept(seq, token)
            if refusal is not None or self.terminated(seq):
                return refusal
        return None

    def accept_step(self, items: Seq[tuple[Sequence, Seq[int]]]) -> dict[int, Refusal]:
        """:meth:`accept_tokens` for a step's sequences and tokens; the refusals by seq_id. The
        common case, one token for a sequence with a matcher, goes to xgrammar in one call."""
        if self.fast_rows:
            return self._fast_accept(items)
        refusals: dict[int, Refusal] = {}
        single: list[tuple[Sequence, _Matched, int]] = []
        for seq, tokens in items:
            entry = self._matchers.get(seq.seq_id)
            if entry is None:
                continue
            if (len(tokens) == 1 and seq.seq_id not in self._dead_ends and seq.seq_id not in self._faults
                    and not entry.matcher.is_terminated()):
                single.append((seq, entry, tokens[0]))
                continue
            refusal = self.accept_tokens(seq, tokens)
            if refusal is not None:
                refusals[seq.seq_id] = refusal
        if single:
            import xgrammar as xg

            try:
                ok: list[bool | None] = list(xg.BatchGrammarMatcher.batch_accept_token(
                    [m.matcher for _, m, _ in single], [t for *_, t in single]))
            except Exception:  # some matcher's accept raised: row by row, to find it and accept the others
                ok = [self._accept_after_batch(entry, token) for _, entry, token in single]
            for (seq, entry, token), accepted in zip(single, ok, strict=True):
                if accepted is None:  # it raised: a fault (_raised)
                    refusals[seq.seq_id] = self._fault(seq, entry)
                elif not accepted:  # the mask allowed it: a fault of ours
                    refusals[seq.seq_id] = self._rejected(seq, entry, token)
                else:
                    self._accepted(entry, token)
        return refusals

    def _fast_accept(self, items: Seq[tuple[Sequence, Seq[int]]]) -> dict[int, Refusal]:
        """:meth:`accept_step` with the flags instead of a query per matcher, xgrammar's handles
        passed directly, and its answer compared whole (converting it element by element cost
        ~90 us for 64 rows, more than the accepting itself)."""
        from xgrammar.base import _core

        refusals: dict[int, Refusal] = {}
        matchers, dead_ends, faults = self._matchers, self._dead_ends, self._faults
        # Rows in one state given one token are one group: a matcher of the group that is up to date
        # accepts for all; the others take the token as pending.
        groups: dict[tuple[int, int], list[_Matched]] = {}
        for seq, toks in items:
            entry = matchers.get(seq.seq_id)
            if entry is None:
                continue
            if (len(toks) == 1 and not entry.terminated and not (dead_ends and seq.seq_id in dead_ends)
                    and not (faults and seq.seq_id in faults)):
                groups.setdefault((entry.state, toks[0]), []).append(entry)
                continue
            refusal = self.accept_tokens(seq, toks)
            if refusal is not None:
                refusals[seq.seq_id] = refusal
        if not groups:
            return refusals
        handles: list[Any] = []
        tokens: list[int] = []
        leads: list[_Matched] = []
        live: list[list[_Matched]] = []
        for (_, token), members in groups.items():
            lead = next((m for m in members if not m.pending), None)
            while lead is None and members:  # every member lags: the first that catches up leads
                if self._sync(members[0]) is None:
                    out = members.pop(0)
                    refusals[out.seq.seq_id] = self._fault(out.seq, out)
                else:
                    lead = members[0]
            if lead is None:
                continue
            handles.append(lead.handle)
            tokens.append(token)
            leads.append(lead)
            live.append(members)
        if not handles:
            return refusals
        try:
            ok = _core.BatchGrammarMatcher.batch_accept_token(handles, tokens, False)
        except Exception:  # some matcher's accept raised: group by group, to find it and accept the others
            for lead, token, members in zip(leads, tokens, live, strict=True):
                self._accept_group_after_batch(lead, token, members, refusals)
            return refusals
        # xgrammar's Array compares structurally with a list: all accepted in one comparison; any
        # other answer (a refusal, or another element type) is read element by element.
        every = ok == [1] * len(handles)
        for k, (lead, token, members) in enumerate(zip(leads, tokens, live, strict=True)):
            if every or ok[k]:
                self._accepted(lead, token)
                for m in members:
                    if m is not lead:
                        m.pending.append(token)
                        m.state, m.terminated = lead.state, lead.terminated
            else:  # the mask allowed it: a fault of ours (and the same for every row in that state)
                for m in members:
                    refusals[m.seq.seq_id] = self._rejected(m.seq, m, token)
        return refusals

    def _sync(self, entry: _Matched) -> xgrammar.GrammarMatcher | None:
        """``entry``'s matcher, given the tokens another matcher in its state accepted for it; None
        when it refuses one (out of step: recorded for :meth:`_fault`, never raised, since the
        other sequences of the step must go on)."""
        if entry.pending:
            for token in entry.pending:
                try:
                    accepted = entry.matcher.accept_token(token)
                except Exception as exc:
                    self._raised(entry, exc, f"catching up on token {token}, which a matcher in the same state "
                                 "accepted")
                    accepted = False
                if not accepted:  # another matcher in this state accepted it
                    self._faults.setdefault(entry.seq.seq_id, (
                        f"the grammar's matcher refused token {token}, which a matcher in the same state "
                        f"accepted, after {entry.seq.num_known_tokens - entry.seq.num_prompt_tokens} "
                        "generated tokens"))
                    entry.pending.clear()
                    return None
                entry.taken += 1
            entry.pending.clear()
        if entry.seq.seq_id in self._faults:
            return None
        return entry.matcher

    def _raised(self, entry: _Matched, exc: Exception, doing: str) -> None:
        """xgrammar raised for ``entry``'s matcher while ``doing``: a fault of that sequence alone,
        recorded for :meth:`_fault` (its rows are left open, its next accept fails its request with
        INTERNAL); the other sequences of the step go on."""
        seq = entry.seq
        generated = seq.num_known_tokens - seq.num_prompt_tokens
        self._faults.setdefault(seq.seq_id, f"the grammar's matcher raised {type(exc).__name__}: {exc} while "
                                            f"{doing}, after {generated} generated tokens")
        log.error("grammar matcher fault: its request fails, the others go on", request_id=seq.request_id,
                  field=entry.field, doing=doing, generated_tokens=generated, error=repr(exc))

    def record_fault(self, seq: Sequence, exc: Exception, doing: str) -> None:
        """:meth:`_raised` for ``seq`` (a matched sequence) from outside: fault injection in tests."""
        self._raised(self._matchers[seq.seq_id], exc, doing)

    def _took(self, entry: _Matched) -> bool:
        """Whether ``entry``'s matcher holds one token more than it is known to have accepted: a
        batch accept that raised had reached it (xgrammar's loop goes row by row, and stops at the
        row that raises). Read on a fork: rolling back past a matcher's history raises."""
        probe = entry.matcher.fork()
        try:
            probe.rollback(entry.taken + 1)
        except Exception:  # its history is no longer than what it is known to have accepted
            return False
        return True

    def _accept_after_batch(self, entry: _Matched, token: int) -> bool | None:
        """``token`` into ``entry``'s matcher after the batch accept that held it raised: True if
        accepted (by that batch, before it stopped, or now), False if refused, None if it raised (a
        fault, recorded)."""
        try:
            return self._took(entry) or bool(entry.matcher.accept_token(token))
        except Exception as exc:
            self._raised(entry, exc, f"accepting token {token}")
            return None

    def _accept_group_after_batch(self, lead: _Matched, token: int, members: list[_Matched],
                                  refusals: dict[int, Refusal]) -> None:
        """:meth:`_fast_accept`'s work for one group (rows in one state given one token) after the
        batch accept raised: its lead, or if that one is a fault, the next member that catches up,
        accepts for all; a fault fails its own request alone."""
        rest = [lead, *(m for m in members if m is not lead)]
        for i, entry in enumerate(rest):
            # the lead may have taken the token before the batch stopped; the others catch up first
            accepted = (None if entry is not lead and self._sync(entry) is None
                        else self._accept_after_batch(entry, token))
            if accepted is None:
                refusals[entry.seq.seq_id] = self._fault(entry.seq, entry)
            elif accepted:
                self._accepted(entry, token)
                for m in rest[i + 1:]:
                    m.pending.append(token)
                    m.state, m.terminated = entry.state, entry.terminated
                return
            else:  # the mask allowed it: a fault of ours (and the same for every row in that state)
                for m in rest[i:]:
                    refusals[m.seq.seq_id] = self._rejected(m.seq, m, token)
                return

    def host_fault(self, seq: Sequence, doing: str, exc: Exception) -> Refusal | None:
        """The refusal of ``seq``'s request when the grammar's host work raised outside xgrammar
        while ``doing`` (the engine's backstop: every constrained sequence of that step fails
        so); None for a sequence without a matcher."""
        entry = self._matchers.get(seq.seq_id)
        if entry is None:
            return None
        return Refusal(seq.request_id, f"structured output failed while {doing} ({type(exc).__name__}: {exc}); "
                       "a fault of the server, not of the request",
                       Rejection("INTERNAL", entry.field, "GRAMMAR_MATCHER_FAULT"))

    def _fault(self, seq: Sequence, entry: _Matched) -> Refusal:
        """The refusal of a sequence whose matcher is out of step (:meth:`_sync`) or raised (:meth:`_raised`)."""
        # the fault stays recorded until the sequence is forgotten: its rows stay open meanwhile
        message = self._faults.get(seq.seq_id, "the grammar's matcher is out of step")
        return Refusal(seq.request_id, message, Rejection("INTERNAL", entry.field, "GRAMMAR_MATCHER_FAULT"))

    @staticmethod
    def _rejected(seq: Sequence, entry: _Matched, token: int) -> Refusal:
        return Refusal(seq.request_id, f"token {token} does not match the constraint after "
                       f"{seq.num_known_tokens - seq.num_prompt_tokens} generated tokens",
                       Rejection("INTERNAL", entry.field, "GRAMMAR_TOKEN_REJECTED"))

    def terminated(self, seq: Sequence) -> bool:
        """Whether ``seq``'s matcher has matched a whole sentence and accepted its EOS."""
        entry = self._matchers.get(seq.seq_id)
        return entry is not None and (entry.terminated if self.fast_rows else entry.matcher.is_terminated())

    def has_matcher(self, seq: Sequence) -> bool:
        return seq.seq_id in self._matchers
