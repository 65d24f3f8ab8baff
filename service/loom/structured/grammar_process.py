"""Structured output's matchers in a process of their own, so that their work leaves the engine's thread.

Why: SmolLM2 at batch 64 on the H200 is host-bound (its forward is shorter than the ~1.2 ms of the
engine's host work a step), and the grammar's host work (~0.5 ms a step for 64 distinct states:
accepting their tokens, filling their masks, two thirds of it the driver's own Python) sat on the
engine's thread between reading step N's tokens back and queueing step N+1's sampling. A thread
could not take it off, because its Python holds the interpreter lock (docs/structured-output.md,
session 29); a process can.

How: the child (``python -m loom.structured.grammar_process``) runs the same driver
(:class:`~loom.structured.driver.StructuredOutput`) and compiler pool, on mirrors of the engine's
sequences (:class:`_Mirror`); the engine talks to :class:`GrammarProcess`, which has the driver's
interface. The compiled grammars never cross (a compiled grammar does not serialize cheaply), only
grammar texts, sequence ids, tokens and, through shared memory, the rows. A constrained step:

1. ``will_sample`` as step N+1 is launched (its forward queued): its rows' layout is kept;
2. ``accept_step`` as step N's tokens are processed: they go to the child with step N+1's layout in
   one message; the child accepts them and fills N+1's rows into shared memory while the engine
   finishes N's outputs, returns them, and schedules and plans step N+2;
3. ``bitmask_rows`` when step N+2 is about to be queued: the engine takes the rows (there by then,
   unless the child is slower than the engine's step), queues step N+1's sampling with them, then
   N+2's forward. The engine defers a constrained step's sampling to the next launch for this
   (``fills_ahead``). With ``LOOM_GRAMMAR_DEVICE_WAIT`` on page-locked rows it does not wait
   here: the rows are numbered by the engine, the child signals its fill in a shared flag after
   writing them, the device's stream waits for the flag before copying them, and the engine
   reads the child's reply (:meth:`GrammarProcess.await_rows`) only before step N+1's tokens.

What the engine would have to wait for, it predicts: a token its mask allowed is accepted, and an
EOS its mask allowed ends the grammar (:meth:`GrammarProcess.terminated`). The child checks; a token
its matcher refuses or raises on (a fault of Loom's or xgrammar's, never of the request) fails that
request when the next rows come back (:meth:`GrammarProcess.take_refusals`), after the token was
streamed. A row the child leaves open (no token can continue the grammar: a dead end; or its matcher
raised while filling) is known with the rows, so the sequence's next accept is refused before its
token is used, exactly as in the engine's own process. Should the child die, its constrained
requests fail (INTERNAL) and the next constrained request starts a new one.
"""

from __future__ import annotations

import dataclasses
import gc
import mmap
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any

import structlog
import torch

from loom.engine.sequence import Sequence
from loom.engine.types import Rejection
from loom.process_tuning import freeze_startup_objects
from loom.sample.batch import TokenBitmaskRows

from .compiler_pool import CompileStats
from .driver import Refusal
from .shared_rows import SharedRows, mapping_bytes
from .spec import GrammarSpec

log = structlog.get_logger(__name__)

# Messages are pickled here rather than by Connection.send, whose ForkingPickler costs ~2x more
# per call (it builds a pickler and a buffer each time) for the same bytes.
_PROTOCOL = pickle.HIGHEST_PROTOCOL
_POLL_S = 0.002  # the child's wait for a message while grammars compile: then it looks for ready ones
# How long the engine's thread waits, at most, for the child to confirm requests whose grammar it
# compiled before (cache hits there answer within ~0.1 ms a request): what an in-process cache hit
# gives, the request joining the batch in the step it arrived for, instead of the step after (which
# splits a burst's prefill into two steps: ~50 ms more for S1's 64 requests on the H200).
_CACHED_READY_WAIT_S = 0.010
_KNOWN_COMPILED = 4096  # grammar texts remembered as compiled in the child (most recent)


def spin_until_readable(conn: Connection, seconds: float) -> bool:
    """Poll ``conn`` without sleeping for up to ``seconds``; whether a message came. A process
    blocked in a read is woken by the kernel when a message arrives, which costs tens of
    microseconds each way (a ping-pong of two processes on the project's VM: ~100 us a round
    trip blocked, ~28 us polled); while the other side's reply is due within a step, polling
    on a core of its own costs nothing else (``LOOM_GRAMMAR_SPIN_US``)."""
    end = time.perf_counter() + seconds
    while not conn.poll(0):
        if time.perf_counter() >= end:
            return False
    return True

# A step's rows as the engine describes them to the child: the step's sequence ids and their drafts
# (None: no drafts), then, for a group's child (given only its own sequences), the slot in the
# shared rows of each sampling row and the half to fill (None, None: the child's own rows), and
# whether to signal the fill: every slot written (open where the child has no matcher), then the
# fill id stored in the shared fill flag (LOOM_GRAMMAR_DEVICE_WAIT: the device waits for it).
Layout = tuple[list[int], list[list[int]] | None, list[int] | None, int | None, bool]


@dataclass(frozen=True)
class ProcessConfig:
    """What the child builds its compiler pool and driver from."""

    model_dir: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    compile_timeout_s: float
    cache_bytes: int
    workers: int = 2  # compile threads
    compiler_threads: int = 1  # xgrammar's threads a compile
    fast_rows: bool = True
    fault_injection: bool = False  # tests only: requests named inject-grammar-accept* / -fill* fault here
    parent_pid: int = 0
    log_json: bool = False
    log_level: str = "INFO"
    # How long each side polls, without sleeping, for the other's next step message before it
    # blocks (0: it blocks at once): the engine for the rows it waits on, the child (while it
    # has live constrained sequences) for the next step's tokens (kernel_switches.grammar_spin_us)
    spin_us: int = 0


@dataclass
class WaitStats:
    """What the engine's thread waited for the child's rows (:meth:`GrammarProcess.bitmask_rows`)
    and, asked with :meth:`GrammarProcess.child_stats`, what the child spent (diagnostics:
    ``scripts/profile_s1.py`` reports them per pair)."""

    fills: int = 0  # bitmask_rows calls
    waits: int = 0  # ... that found the rows not there yet
    wait_s: float = 0.0
    max_wait_s: float = 0.0

    def add(self, waited: float) -> None:
        self.fills += 1
        if waited > 0.0:
            self.waits += 1
            self.wait_s += waited
            self.max_wait_s = max(self.max_wait_s, waited)


@dataclass
class ChildStats:
    """The child's own time: step messages handled and their time, and its garbage collections."""

    steps: int = 0
    step_s: float = 0.0
    max_step_s: float = 0.0
    collections: int = 0  # full (generation 2) collections
    collection_s: float = 0.0
    max_collection_s: float = 0.0


class GrammarProcessError(RuntimeError):
    """The grammar process ended or broke the protocol; its constrained requests fail."""


class GrammarProcess:
    """The driver's interface (:class:`~loom.structured.driver.StructuredOutput`), served by a child
    process. Made by the engine on the first constrained request; one per engine."""

    fills_ahead = True  # rows are filled between a step's launch and the next one's: defer sampling

    def __init__(self, config: ProcessConfig, start_timeout_s: float = 120.0, register_rows: bool = False,
                 rows: SharedRows | None = None, device_wait: bool = False) -> None:
        self.config = config
        self.vocab_size = config.vocab_size
        self.words = -(-config.vocab_size // 32)  # int32 words per bitmask row
        # The rows the child fills: its own (page-locked for the GPU with ``register_rows``: copied
        # to the device straight from where the child wrote them), or, in a
        # :class:`~loom.structured.grammar_group.GrammarProcessGroup`, the group's, which each of
        # its children fills at the places the group assigns (:meth:`will_sample`'s ``placement``).
        self._owns_rows = rows is None
        self._rows = SharedRows(self.words, register_rows) if rows is None else rows
        self._mapped = 0  # the rows' generation the child has mapped (0: none)
        self.start_timeout_s = start_timeout_s
        self._held: dict[str, list[Sequence]] = {}  # request id -> its completions, until ready or refused
        self._matched: dict[int, Sequence] = {}  # seq_id -> a sequence that has a matcher in the child
        self._fields: dict[int, str] = {}  # seq_id -> its constraint's request field
        self._ready: list[str] = []  # request ids the child reported compiled, not yet taken
        self._held_keys: dict[str, tuple[str, str]] = {}  # held request id -> its grammar's key
        self._awaited: set[str] = set()  # held requests already waited for once (_await_cache_hits)
        self._compiled: OrderedDict[tuple[str, str], None] = OrderedDict()  # keys the child compiled lately
        self._refused: list[Refusal] = []  # held requests refused, not yet taken
        # holds not sent yet: they go to the child in one message when the engine next takes the
        # ready requests, which the child answers in one (a burst of 64 requests was 64 messages
        # each way)
        self._unsent_holds: list[tuple[str, GrammarSpec, list[tuple[int, int, tuple[int, ...]]]]] = []
        self._early: dict[int, Refusal] = {}  # seq_id -> the refusal of its next accept (its row was left open)
        self._late: list[tuple[int, Refusal]] = []  # refused after their token was used (take_refusals)
        self._stats = CompileStats()
        self._layout: Layout | None = None  # rows of the next bitmask_rows
        self._fill_id = 0  # the layout's number: a reply to an older one (a step that failed) is skipped
        self._fill_sent = False  # a fill is in flight: its reply is the next rows reply
        self._rows_reply: tuple[Any, ...] | None = None  # the layout's rows, read early (while draining)
        self._expect_accept = False  # rows were taken: their tokens will be accepted before the next fill
        # LOOM_GRAMMAR_DEVICE_WAIT (one process, no group): the engine numbers the rows, the child
        # signals its fill in the shared flag, and bitmask_rows on page-locked rows returns without
        # waiting: the device waits for the flag, the engine for the reply only in await_rows
        self.device_wait = device_wait and rows is None
        self._signalled: tuple[list[int], int] | None = None  # the signalled layout's rows and half
        self._step_ids: list[int] = []  # the sequence ids of the step will_sample was told of
        self._dw_half = 1  # the half of the last signalled fill: the next one fills the other
        self._awaiting: tuple[int, int, int] | None = None  # a fill returned unwaited: (fill id, half, rows)
        self._awaited_reply: tuple[Any, ...] | None = None  # its reply, read early (while draining)
        self._broken: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self.waits = WaitStats()
        self._child_stats: ChildStats | None = None
        self._start()

    # -- the child ------------------------------------------------------------------------------------
    def _start(self) -> None:
        from loom.logging_setup import logging_settings

        mine, theirs = socket.socketpair()
        log_json, log_level = logging_settings()
        config = ProcessConfig(**{**self.config.__dict__, "parent_pid": os.getpid(), "log_json": log_json,
                                  "log_level": log_level})
        self._proc = subprocess.Popen([sys.executable, "-m", "loom.structured.grammar_process", str(theirs.fileno())],
                                      stdin=subprocess.PIPE, pass_fds=(theirs.fileno(),))
        assert self._proc.stdin is not None
        self._proc.stdin.write(pickle.dumps(config))
        self._proc.stdin.close()
        theirs.close()
        self._conn = Connection(mine.detach())
        self._mapped = 0
        self._broken = None
        log.info("grammar process started", pid=self._proc.pid)

    def _send(self, msg: tuple[Any, ...]) -> None:
        if self._broken is not None:
            return
        assert self._conn is not None
        try:
            self._conn.send_bytes(pickle.dumps(msg, _PROTOCOL))
        except (OSError, EOFError) as exc:
            self._break(f"sending to it failed: {exc!r}")

    def _recv(self, timeout: float | None, spin: bool = False) -> tuple[Any, ...] | None:
        """The child's next message, or None when none came within ``timeout`` (0: none waiting).
        ``spin``: polled without sleeping for up to ``config.spin_us`` first (a step's rows)."""
        if self._broken is not None:
            return None
        assert self._conn is not None and self._proc is not None
        try:
            if spin and self.config.spin_us:
                spin_until_readable(self._conn, self.config.spin_us / 1e6)
            deadline = None if timeout is None else time.monotonic() + timeout
            while not self._conn.poll(0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))):
                if self._proc.poll() is not None:
                    self._break(f"it exited with code {self._proc.returncode}")
                    return None
                if deadline is not None and time.monotonic() >= deadline:
                    return None
            msg: tuple[Any, ...] = pickle.loads(self._conn.recv_bytes())
            return msg
        except (OSError, EOFError) as exc:
            self._break(f"reading from it failed: {exc!r}")
            return None

    def _break(self, why: str) -> None:
        """The child is gone: every request it held or matched fails; a later hold starts a new one."""
        if self._broken is not None:
            return
        self._broken = why
        log.error("the grammar process ended: its constrained requests fail", reason=why,
                  held=sorted(self._held), matched=len(self._matched))
        for request_id, seqs in self._held.items():
            field = self._fields.get(seqs[0].seq_id, "parameters.constraint")
            self._refused.append(Refusal(request_id, f"structured output failed: the grammar process ended ({why}); "
                                         "a fault of the server, not of the request",
                                         Rejection("INTERNAL", field, "GRAMMAR_MATCHER_FAULT")))
        self._held.clear()
        self._held_keys.clear()
        self._awaited.clear()
        self._unsent_holds.clear()
        self._ready.clear()
        for sid, seq in self._matched.items():
            self._early[sid] = self._lost(seq, why)
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()

    def _lost(self, seq: Sequence, why: str) -> Refusal:
        return Refusal(seq.request_id, f"structured output failed: the grammar process ended ({why}); a fault of "
                       "the server, not of the request",
                       Rejection("INTERNAL", self._fields.get(seq.seq_id, "parameters.constraint"),
                                 "GRAMMAR_MATCHER_FAULT"))

    def close(self) -> None:
        """Stop the child (it also dies with this process)."""
        if self._proc is None:
            return
        self._send(("close",))
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._proc = None
        self._release_awaited()  # (a step in flight: the device must not wait for the flag past this)
        if self._owns_rows:
            self._rows.release()

    def child_stats(self, timeout: float = 5.0) -> ChildStats | None:
        """The child's :class:`ChildStats` so far (None if it does not answer within ``timeout``);
        for diagnostics, between steps."""
        self._child_stats = None
        self._send(("stats",))
        deadline = time.monotonic() + timeout
        while self._child_stats is None and (left := deadline - time.monotonic()) > 0:
            msg = self._recv(left)
            if msg is None:
                break
            self._handle(msg)
        return self._child_stats

    # -- requests -------------------------------------------------------------------------------------
    def hold(self, request_id: str, spec: GrammarSpec, seqs: list[Sequence]) -> None:
        if self._broken is not None and not self._matched_alive():
            self._restart()
        for seq in seqs:
            self._fields[seq.seq_id] = spec.field
        self._held[request_id] = seqs
        self._held_keys[request_id] = spec.key
        if self._broken is not None:  # (a sequence of the dead child's is still running: refused at once)
            self._held.pop(request_id)
            self._forget_held(request_id)
            self._refused.append(self._lost(seqs[0], self._broken))
            return
        self._unsent_holds.append((request_id, spec, [(s.seq_id, s.stopping.min_new_tokens,
                                                       tuple(s.stopping.stop_token_ids)) for s in seqs]))

    def _send_holds(self) -> None:
        """The holds made since the last look, to the child in one message (it answers them in one)."""
        if self._unsent_holds:
            holds, self._unsent_holds = self._unsent_holds, []
            self._send(("holds", holds))

    def _matched_alive(self) -> bool:
        return any(not s.is_finished for s in self._matched.values())

    def _restart(self) -> None:
        log.info("starting a new grammar process", previous=self._broken)
        self._release_awaited()  # (its requests have all finished: nobody reads those rows)
        if self._conn is not None:
            self._conn.close()
        self._matched.clear()
        self._early.clear()
        self._late.clear()
        self._layout, self._fill_sent, self._expect_accept = None, False, False
        self._start()

    @property
    def num_held(self) -> int:
        # a ready request stays in _held until take_ready takes it (its id in _ready too): once
        return len(self._held) + len(self._refused)

    @property
    def load(self) -> int:
        """Constrained sequences held or matched here (a group gives a request to the least loaded)."""
        return len(self._matched) + sum(len(seqs) for seqs in self._held.values())

    def flush(self) -> None:
        """Send what waits to be sent: finished sequences to forget, held requests to compile."""
        self.forget_finished()
        self._send_holds()

    def take_ready(self) -> tuple[list[list[Sequence]], list[Refusal]]:
        """Requests whose grammar the child compiled (their sequences now have matchers there) and
        requests refused; held requests aborted meanwhile are dropped (the child is told)."""
        self.flush()
        self._drain()
        self._await_cache_hits()
        ready: list[list[Sequence]] = []
        for request_id in self._ready:
            self._forget_held(request_id)
            seqs = self._held.pop(request_id, None)
            if seqs is None:
                continue
            for seq in seqs:
                self._matched[seq.seq_id] = seq
            ready.append(seqs)
        self._ready.clear()
        refused, self._refused = self._refused, []
        for request_id, seqs in list(self._held.items()):
            if all(s.is_finished for s in seqs):  # aborted while its grammar compiled
                del self._held[request_id]
                self._forget_held(request_id)
                self._send(("drop", request_id))
        return ready, refused

    def _forget_held(self, request_id: str) -> None:
        self._held_keys.pop(request_id, None)
        self._awaited.discard(request_id)

    def _await_cache_hits(self) -> None:
        """Wait (briefly) for the child's answer on held requests whose grammar it compiled before:
        they are ready there at once, so they join this step as they would in this process."""
        compiled = self._compiled
        if not compiled or not self._held:
            return
        answered, awaited = set(self._ready), self._awaited
        # Each request is waited for once: a text the child has since evicted compiles for real,
        # and the steps meanwhile must not wait again.
        waiting = {rid for rid in self._held
                   if rid not in answered and rid not in awaited and self._held_keys.get(rid) in compiled}
        if not waiting:
            return
        awaited.update(waiting)
        deadline = time.monotonic() + _CACHED_READY_WAIT_S
        while waiting and (left := deadline - time.monotonic()) > 0:
            msg = self._recv(left)
            if msg is None:
                return
            self._handle(msg)
            waiting.difference_update(self._ready)
            waiting.intersection_update(self._held)  # (refused ones left _held)

    def _drain(self) -> None:
        """Read what the child sent unasked (ready and refused requests) without waiting."""
        while (msg := self._recv(0)) is not None:
            self._handle(msg)

    def _handle(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "ready":
            _, request_ids, refused, stats = msg
            self._ready.extend(request_ids)
            for rid in request_ids:
                key = self._held_keys.get(rid)
                if key is not None:
                    self._compiled[key] = None
                    self._compiled.move_to_end(key)
            while len(self._compiled) > _KNOWN_COMPILED:
                self._compiled.popitem(last=False)
            for r in refused:
                self._forget_held(r.request_id)
                if self._held.pop(r.request_id, None) is not None:
                    self._refused.append(r)
            self._stats = stats
        elif kind == "stats":
            self._child_stats = ChildStats(**msg[1])
        elif kind in ("rows", "rows_failed"):
            self._late.extend(msg[-2])  # (a stale reply's too: those tokens were used)
            if msg[-1] is not None:  # (sent when they changed; a stale reply's too)
                self._stats = msg[-1]
            if msg[1] == self._fill_id and self._layout is not None:  # else a step that failed asked for it
                self._rows_reply = msg
            elif self._awaiting is not None and msg[1] == self._awaiting[0]:
                self._awaited_reply = msg
        else:
            raise GrammarProcessError(f"unexpected message from the grammar process: {kind!r}")

    def forget_finished(self) -> None:
        done = [sid for sid, s in self._matched.items() if s.is_finished]
        if not done:
            return
        for sid in done:
            del self._matched[sid]
            self._fields.pop(sid, None)
            self._early.pop(sid, None)
        self._send(("forget", done))

    @property
    def num_matched(self) -> int:
        return len(self._matched)

    def has_matcher(self, seq: Sequence) -> bool:
        return seq.seq_id in self._matched

    def compile_stats(self) -> CompileStats:
        return self._stats

    # -- steps ----------------------------------------------------------------------------------------
    def any_matched(self, seqs: Seq[Sequence]) -> bool:
        matched = self._matched
        return bool(matched) and any(seq.seq_id in matched for seq in seqs)

    def will_sample(self, seqs: Seq[Sequence], drafts: Seq[Seq[int]] | None = None,
                    placement: tuple[list[int], int] | None = None) -> None:
        """The rows of the step just launched: sent with the previous step's tokens when those are
        still to be accepted (the fill must see them), else now. ``placement`` (a group's child):
        (the slot of each sampling row in the shared rows; the half to fill), where
        the child writes its rows instead of from the first row of a half of its choosing."""
        ids = [s.seq_id for s in seqs]
        guesses = [list(d) for d in drafts] if drafts is not None and any(drafts) else None
        self._step_ids, self._signalled = ids, None
        if placement is None and self.device_wait and guesses is None:
            # the engine numbers the rows (its matched sequences, in order, at slots 0..G-1 of the
            # half not filled last) so that it can hand them to the sampling before the child replies
            matched = self._matched
            rows = [i for i, sid in enumerate(ids) if sid in matched]
            half = self._dw_half ^ 1
            self._reserve(len(rows))
            self._layout = ([ids[i] for i in rows], None, list(range(len(rows))), half, True)
            self._signalled = (rows, half)
        elif placement is None:
            n = sum(1 + (len(guesses[i]) if guesses is not None else 0)
                    for i, sid in enumerate(ids) if sid in self._matched)
            self._reserve(n)
            self._layout = (ids, guesses, None, None, False)
        else:
            self._reserve(0)  # (the group reserved them: mapped here if the child has not yet)
            self._layout = (ids, guesses, *placement, False)
        self._fill_id += 1
        self._fill_sent, self._rows_reply = False, None
        if not self._expect_accept:
            self._send(("step", None, self._layout, self._fill_id))
            self._fill_sent = True

    def _reserve(self, rows: int) -> None:
        """Shared rows for at least ``rows`` (two halves of them, used in turn), made before the
        fill that needs them; the child maps them when told."""
        if self._broken is not None:
            return
        shared = self._rows
        shared.reserve(rows)
        if self._mapped == shared.generation or shared.fd is None:
            return
        self._send(("buffers", shared.capacity))
        if self._broken is None:
            assert self._conn is not None and self._proc is not None
            reduction.send_handle(self._conn, shared.fd, self._proc.pid)
            self._mapped = shared.generation

    def accept_step(self, items: Seq[tuple[Sequence, Seq[int]]]) -> dict[int, Refusal]:
        """Step N's tokens to the child (with step N+1's rows to fill, when known). Returns the
        refusals known now: sequences whose rows were left open last step (their token is not used)."""
        if self._awaiting is not None:  # (the engine reads a signalled fill's reply before its tokens)
            self.await_rows()
        refusals: dict[int, Refusal] = {}
        sent: list[tuple[int, list[int]]] = []
        early, matched = self._early, self._matched
        for seq, tokens in items:
            sid = seq.seq_id
            if sid not in matched:
                continue
            if early and sid in early:
                refusals[sid] = early.pop(sid)
                continue
            sent.append((sid, list(tokens)))
        self._expect_accept = False
        layout = None if self._fill_sent else self._layout
        if sent or layout is not None:
            self._send(("step", sent, layout, self._fill_id))
            if layout is not None:
                self._fill_sent = True
        return refusals

    def bitmask_rows(self, seqs: Seq[Sequence], drafts: Seq[Seq[int]] | None = None) -> TokenBitmaskRows | None:
        """The rows of the step :meth:`will_sample` was told of (``seqs`` must be its sequences),
        waiting for the child if it has not finished them. A signalled fill on page-locked rows is
        returned at once (``ready``: the device waits for the flag; :meth:`await_rows` reads the
        reply)."""
        signalled = self._signalled
        if signalled is not None and signalled[0] and self._rows.registered and self._broken is None:
            return self._unwaited_rows(seqs, *signalled)
        taken = self.take_rows(seqs)
        if taken is not None and signalled is not None:  # the child wrote every slot: the engine's rows
            taken = signalled
            self._dw_half = signalled[1]
        if taken is None:
            return None
        rows, half = taken
        # (the child writes rows again only once this step's tokens reach it, which the engine
        # reads after this step's sampling ran: the copy to the device, queued before it, has too)
        return TokenBitmaskRows(rows, self.words, self._rows.views[half][: len(rows)], registered=self._rows.registered)

    def _unwaited_rows(self, seqs: Seq[Sequence], rows: list[int], half: int) -> TokenBitmaskRows:
        if self._step_ids != [s.seq_id for s in seqs]:
            raise GrammarProcessError("the grammar rows asked for are not those of the step launched last")
        if not self._fill_sent:
            self._send(("step", None, self._layout, self._fill_id))
        assert self._rows.flag is not None
        # (its reply may have come already, read while the engine took the ready requests)
        self._awaiting, self._awaited_reply = (self._fill_id, half, len(rows)), self._rows_reply
        self._layout, self._fill_sent, self._signalled, self._rows_reply = None, False, None, None
        self._expect_accept = True
        self._dw_half = half
        return TokenBitmaskRows(rows, self.words, self._rows.views[half][: len(rows)], registered=True,
                                ready=(self._rows.flag, self._fill_id))

    def await_rows(self) -> None:
        """The child's reply to the fill :meth:`bitmask_rows` returned unwaited (the device waits for
        its flag): the refusals of next accepts it brings are noted. Nothing when none is due.
        Should the child have ended first, its rows are opened and the flag set here, so that the
        device goes on, and this raises :class:`GrammarProcessError` (the step's constrained
        requests fail, as when a wait in :meth:`take_rows` fails)."""
        if self._awaiting is None:
            return
        started = time.perf_counter()
        while self._awaited_reply is None:
            msg = self._recv(None, spin=True)
            if msg is None:
                break
            self._handle(msg)
        self.waits.add(time.perf_counter() - started)
        msg, self._awaited_reply = self._awaited_reply, None
        if msg is None:
            self._release_awaited()  # open: the step's constrained requests fail below
            raise GrammarProcessError(f"the grammar process ended ({self._broken})")
        self._awaiting = None
        if msg[0] == "rows_failed":  # (the child opened its rows and set the flag itself)
            raise GrammarProcessError(f"filling the rows failed in the grammar process: {msg[2]}")
        for sid, refusal in msg[4]:
            if sid in self._matched:
                self._early[sid] = refusal

    def _release_awaited(self) -> None:
        """The fill returned unwaited will not come (the child ended, or is replaced): its rows are
        opened and its id set in the flag here, so that the device, waiting for it, goes on."""
        if self._awaiting is None:
            return
        fill_id, half, n = self._awaiting
        self._awaiting, self._awaited_reply = None, None
        flag = self._rows.flag
        if flag is None:
            return
        self._rows.views[half][:n] = -1
        flag[0] = fill_id  # (after the rows, as the child does)

    def take_rows(self, seqs: Seq[Sequence]) -> tuple[list[int], int] | None:
        """:meth:`bitmask_rows`'s wait: the sampling rows the child filled (ascending) and the
        shared half that holds them (placed as :meth:`will_sample` said, for a group's child; else
        from the half's first row), or None when it filled none."""
        if self._layout is None or self._step_ids != [s.seq_id for s in seqs]:
            raise GrammarProcessError("the grammar rows asked for are not those of the step launched last")
        if self._broken is not None:
            if not any(s.seq_id in self._matched and not s.is_finished for s in seqs):
                return None  # (its constrained requests failed already)
            raise GrammarProcessError(f"the grammar process ended ({self._broken})")
        if not self._fill_sent:
            self._send(("step", None, self._layout, self._fill_id))
            self._fill_sent = True
        waited = 0.0
        if self._rows_reply is None:
            started = time.perf_counter()
            while self._rows_reply is None:
                msg = self._recv(None, spin=True)
                if msg is None:
                    raise GrammarProcessError(f"the grammar process ended ({self._broken})")
                self._handle(msg)
            waited = time.perf_counter() - started
        self.waits.add(waited)
        msg, self._rows_reply = self._rows_reply, None
        self._layout, self._fill_sent = None, False
        self._expect_accept = True
        if msg[0] == "rows_failed":
            raise GrammarProcessError(f"filling the rows failed in the grammar process: {msg[2]}")
        _, _, rows, half, early, _, _ = msg
        for sid, refusal in early:
            if sid in self._matched:
                self._early[sid] = refusal
        return (rows, half) if rows else None

    def take_refusals(self) -> list[Refusal]:
        """Requests whose token the child refused after it was used (faults): the engine fails
        those still running."""
        if not self._late:
            return []
        late, self._late = self._late, []
        out: dict[str, Refusal] = {}
        for sid, refusal in late:
            seq = self._matched.get(sid)
            if seq is not None and not seq.is_finished:
                out.setdefault(refusal.request_id, refusal)
            else:
                log.error("the grammar process refused a token of a finished completion", request_id=refusal.request_id,
                          error=refusal.message)
        return list(out.values())

    def terminated(self, seq: Sequence) -> bool:
        """Asked for a token that is an EOS: its mask allowed it, so its grammar ended (the child
        checks; :meth:`take_refusals` reports otherwise)."""
        return seq.seq_id in self._matched

    def host_fault(self, seq: Sequence, doing: str, exc: Exception) -> Refusal | None:
        if seq.seq_id not in self._matched:
            return None
        return Refusal(seq.request_id, f"structured output failed while {doing} ({type(exc).__name__}: {exc}); "
                       "a fault of the server, not of the request",
                       Rejection("INTERNAL", self._fields.get(seq.seq_id, "parameters.constraint"),
                                 "GRAMMAR_MATCHER_FAULT"))


# -- the child ---------------------------------------------------------------------------------------------


class _Stopping:
    __slots__ = ("min_new_tokens", "stop_token_ids")

    def __init__(self, min_new_tokens: int, stop_token_ids: tuple[int, ...]) -> None:
        self.min_new_tokens = min_new_tokens
        self.stop_token_ids = stop_token_ids


class _Mirror:
    """What the driver reads of an engine sequence, kept from the engine's messages: its ids, its
    stopping rules, the tokens its matcher was given (its output so far) and whether it finished."""

    __slots__ = ("finished", "num_known_tokens", "request_id", "seq_id", "stopping")
    num_prompt_tokens = 0  # counts start at its output

    def __init__(self, seq_id: int, request_id: str, min_new_tokens: int = 0,
                 stop_token_ids: tuple[int, ...] = ()) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.stopping = _Stopping(min_new_tokens, stop_token_ids)
        self.num_known_tokens = 0
        self.finished = False

    @property
    def is_finished(self) -> bool:
        return self.finished

    @property
    def num_output_tokens(self) -> int:  # as the engine's while the token being accepted is in place
        return self.num_known_tokens + 1


class _Server:
    def __init__(self, conn: Connection, config: ProcessConfig) -> None:
        from .compiler_pool import GrammarCompilerPool
        from .driver import StructuredOutput
        from .vocabulary import vocabulary_from_model_dir

        self.conn = conn
        self.config = config
        model_dir, vocab, eos = config.model_dir, config.vocab_size, config.eos_token_ids
        pool = GrammarCompilerPool(lambda: vocabulary_from_model_dir(model_dir, vocab, eos), workers=config.workers,
                                   cache_bytes=config.cache_bytes, compiler_threads=config.compiler_threads)
        self.driver = StructuredOutput(pool, vocab, eos, config.compile_timeout_s, fast_rows=config.fast_rows)
        self.words = self.driver.words
        self.mirrors: dict[int, _Mirror] = {}
        self.requests: dict[str, list[_Mirror]] = {}  # held requests' mirrors
        self.late: list[tuple[int, Refusal]] = []
        self.halves: list[torch.Tensor] = []
        self.buffer: mmap.mmap | None = None
        self.flag: torch.Tensor | None = None  # [1] int32: the shared fill flag (signalled fills)
        self.last_half = 1
        self.stats = ChildStats()
        self._sent_stats: CompileStats | None = None  # the compile statistics the engine has
        self._gc_started = 0.0
        self._frozen_after_first_ready = False
        self._freezing = False  # the collection freeze_startup_objects runs on purpose is not counted
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        """Times full collections: one stalls every constrained request's next step while it runs."""
        if info.get("generation") != 2 or self._freezing:
            return
        if phase == "start":
            self._gc_started = time.perf_counter()
            return
        took = time.perf_counter() - self._gc_started
        st = self.stats
        st.collections += 1
        st.collection_s += took
        st.max_collection_s = max(st.max_collection_s, took)
        if took > 0.010:
            log.warning("grammar process: a full garbage collection paused it", ms=round(took * 1e3, 1))

    def run(self) -> None:
        conn, driver = self.conn, self.driver
        spin_s = self.config.spin_us / 1e6
        while True:
            try:
                # constrained sequences are live, none compiling (whose readiness the timed poll
                # below looks for): the next step's tokens are near
                if spin_s and self.mirrors and not driver.num_held:
                    spin_until_readable(conn, spin_s)
                raw = conn.recv_bytes() if conn.poll(_POLL_S if driver.num_held else None) else None
            except (EOFError, OSError):  # the engine closed its end (it exited without a close)
                return
            if raw is not None:
                msg = pickle.loads(raw)
                kind = msg[0]
                if kind == "close":
                    return
                started = time.perf_counter()
                try:
                    getattr(self, f"_on_{kind}")(*msg[1:])
                except Exception as exc:  # a message the driver failed on: logged, the loop goes on
                    log.error("grammar process: handling a message failed", kind=kind, error=repr(exc), exc_info=exc)
                    if kind == "step" and msg[2] is not None:
                        if msg[2][4]:  # a signalled fill: the device goes on, with the rows open
                            self._signal(msg[2], msg[3], ())
                        self._reply(("rows_failed", msg[3], repr(exc), self._take_late(), None))
                if kind == "step":
                    took = time.perf_counter() - started
                    self.stats.steps += 1
                    self.stats.step_s += took
                    self.stats.max_step_s = max(self.stats.max_step_s, took)
            if driver.num_held:
                self._report_ready()

    def _reply(self, msg: tuple[Any, ...]) -> None:
        self.conn.send_bytes(pickle.dumps(msg, _PROTOCOL))

    def _take_late(self) -> list[tuple[int, Refusal]]:
        late, self.late = self.late, []
        return late

    def _on_stats(self) -> None:
        # (a dict: this module is __main__ here, so its classes would not unpickle in the engine)
        self._reply(("stats", dataclasses.asdict(self.stats)))

    def _report_ready(self) -> None:
        ready, refused = self.driver.take_ready()
        if not self._frozen_after_first_ready and self.driver.pool.ready_at is not None:
            # The vocabulary and the compiler now exist: what is alive is start-up state, exempt
            # from later full collections (as the engine process freezes its own, process_tuning),
            # and the collector, off while the vocabulary was described (its hundreds of thousands
            # of new objects set off full collections of 10-116 ms on the H200's host), is on again.
            self._frozen_after_first_ready = True
            self._freezing = True
            freeze_startup_objects()
            self._freezing = False
            gc.enable()
        if ready or refused:
            for seqs in ready:
                self.requests.pop(seqs[0].request_id, None)
            for r in refused:
                for m in self.requests.pop(r.request_id, []):
                    self.mirrors.pop(m.seq_id, None)
            self._sent_stats = self.driver.compile_stats()
            self._reply(("ready", [seqs[0].request_id for seqs in ready], refused, self._sent_stats))

    def _on_holds(self, holds: list[tuple[str, GrammarSpec, list[tuple[int, int, tuple[int, ...]]]]]) -> None:
        for request_id, spec, seqs in holds:
            try:  # one request the driver fails on does not lose the others of its message
                self._hold(request_id, spec, seqs)
            except Exception as exc:
                log.error("grammar process: holding a request failed", request_id=request_id, error=repr(exc),
                          exc_info=exc)

    def _hold(self, request_id: str, spec: GrammarSpec, seqs: list[tuple[int, int, tuple[int, ...]]]) -> None:
        mirrors = [_Mirror(sid, request_id, min_new, stops) for sid, min_new, stops in seqs]
        for m in mirrors:
            self.mirrors[m.seq_id] = m
        self.requests[request_id] = mirrors
        self.driver.hold(request_id, spec, mirrors)  # type: ignore[arg-type]  # (what the driver reads of one)

    def _on_drop(self, request_id: str) -> None:
        for m in self.requests.pop(request_id, []):
            m.finished = True
            self.mirrors.pop(m.seq_id, None)

    def _on_forget(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            m = self.mirrors.pop(sid, None)
            if m is not None:
                m.finished = True
        self.driver.forget_finished()

    def _on_buffers(self, capacity: int) -> None:
        fd = reduction.recv_handle(self.conn)
        try:
            self.buffer = mmap.mmap(fd, mapping_bytes(capacity, self.words))
        finally:
            os.close(fd)
        n = capacity * self.words
        self.flag = torch.frombuffer(self.buffer, dtype=torch.int32, count=1, offset=2 * n * 4)
        self.halves = [torch.frombuffer(self.buffer, dtype=torch.int32, count=n, offset=i * n * 4).view(capacity,
                                                                                                       self.words)
                       for i in range(2)]
        self.driver._buffers = list(self.halves)  # the fast path fills them in turn, in place

    def _on_step(self, accepts: list[tuple[int, list[int]]] | None, layout: Layout | None, fill_id: int) -> None:
        driver, mirrors = self.driver, self.mirrors
        if accepts:
            items = [(m, tokens) for sid, tokens in accepts if (m := mirrors.get(sid)) is not None]
            if self.config.fault_injection:
                items = self._inject_accept_faults(items)
            try:
                refusals = driver.accept_step(items)  # type: ignore[arg-type]
            except Exception as exc:  # a fault outside xgrammar: every one of them refused
                refusals = {m.seq_id: r for m, _ in items
                            if (r := driver.host_fault(m, "accepting this step's tokens", exc)) is not None}  # type: ignore[arg-type]
            for m, tokens in items:
                m.num_known_tokens += len(tokens)
            self.late.extend(refusals.items())
        if layout is None:
            return
        ids, drafts, slots, half, signal = layout
        seqs = [mirrors.get(sid) or _Mirror(sid, "") for sid in ids]  # unknown ids: rows without a grammar
        if self.config.fault_injection:
            for m in seqs:
                if m.request_id.startswith("inject-grammar-fill") and driver.has_matcher(m):  # type: ignore[arg-type]
                    driver.record_fault(m, RuntimeError("injected: a fill failed in the grammar process"),  # type: ignore[arg-type]
                                        "filling its mask")
        if slots is None or half is None:
            rows = driver.bitmask_rows(seqs, drafts)  # type: ignore[arg-type]
        else:  # a group's child: its rows go where the engine placed them, in the half it named
            rows = driver.bitmask_rows(seqs, drafts, into=(self.halves[half], slots))  # type: ignore[arg-type]
        if signal:  # first: the device may be waiting for these rows
            self._signal(layout, fill_id, rows.rows if rows is not None else ())
        if rows is None:
            self._reply(("rows", fill_id, [], 0, [], self._take_late(), self._stats_if_changed()))
            return
        if half is None:
            half = self._half_of(rows)
        early = ([(m.seq_id, r) for m in seqs if (r := driver.pending_refusal(m)) is not None]  # type: ignore[arg-type]
                 if driver.has_pending_refusals else [])
        # ("rows", fill id, row indices, shared half, refused next accepts, refused tokens, compile stats
        # or None when unchanged)
        self._reply(("rows", fill_id, rows.rows, half, early, self._take_late(), self._stats_if_changed()))

    def _signal(self, layout: Layout, fill_id: int, filled: Seq[int]) -> None:
        """A signalled fill's end: the slots of the sequences it did not fill (no matcher here, or the
        fill failed) are opened, then the fill id goes into the flag, after the rows (the device
        copies them once it sees it)."""
        _, _, slots, half, _ = layout
        assert slots is not None and half is not None and self.flag is not None
        done = set(filled)
        unfilled = [slot for g, slot in enumerate(slots) if g not in done]
        if unfilled:
            self.halves[half][unfilled] = -1
        self.flag[0] = fill_id

    def _stats_if_changed(self) -> CompileStats | None:
        """The compile statistics when they changed since last sent (a step's reply is otherwise
        only its rows: pickling the statistics every step cost more than the rest of the reply)."""
        stats = self.driver.compile_stats()
        if stats == self._sent_stats:
            return None
        self._sent_stats = stats
        return stats

    def _inject_accept_faults(self, items: list[tuple[_Mirror, list[int]]]) -> list[tuple[_Mirror, list[int]]]:
        """Tests only: the tokens of requests named inject-grammar-accept* are refused as a matcher
        that raised would refuse them (the engine learns it after their use)."""
        kept = []
        for m, tokens in items:
            if m.request_id.startswith("inject-grammar-accept"):
                refusal = self.driver.host_fault(m, "accepting this step's tokens",  # type: ignore[arg-type]
                                                 RuntimeError("injected: an accept failed in the grammar process"))
                if refusal is not None:
                    self.late.append((m.seq_id, refusal))
                m.num_known_tokens += len(tokens)
            else:
                kept.append((m, tokens))
        return kept

    def _half_of(self, rows: TokenBitmaskRows) -> int:
        """Which shared half holds ``rows`` (the fast path fills one in place; the draft path's rows
        are copied into the half not used last)."""
        data = rows.data
        if isinstance(data, torch.Tensor):
            for i, half in enumerate(self.halves):
                start = half.data_ptr()
                if start <= data.data_ptr() < start + half.numel() * 4:
                    self.last_half = i
                    return i
        half_i = self.last_half ^ 1
        self.halves[half_i][: len(rows.rows)].copy_(rows.tensor())
        self.last_half = half_i
        return half_i


def main() -> None:
    config: ProcessConfig = pickle.loads(sys.stdin.buffer.read())
    from loom.logging_setup import configure_logging
    from loom.worker.rank_process import die_with_parent

    die_with_parent(config.parent_pid)
    for sig in (signal.SIGINT, signal.SIGTERM):  # the engine decides when it stops
        signal.signal(sig, signal.SIG_IGN)
    configure_logging(json_output=config.log_json, level=config.log_level, process="grammar")
    torch.set_num_threads(1)
    conn = Connection(int(sys.argv[1]))
    server = _Server(conn, config)
    freeze_startup_objects()  # imports and the server's state: never scanned by a full collection
    gc.disable()  # until the vocabulary is described (_report_ready), which collects once itself
    profile_to = os.environ.get("LOOM_GRAMMAR_PROCESS_PROFILE")  # diagnostics: cProfile's stats of the loop
    if profile_to:
        import cProfile

        with cProfile.Profile() as prof:
            server.run()
        prof.dump_stats(profile_to)
    else:
        server.run()
    os._exit(0)  # a compile still running on a pool thread must not hold the exit up


if __name__ == "__main__":
    main()
