"""LOOM_GRAMMAR_DEVICE_WAIT: the grammar process numbers its rows as the engine does, writes every
slot of a step (open where it has no matcher) and then the step's fill id into the shared fill
flag; on page-locked rows the engine queues the sampling without waiting, the copy waits for the
flag (a CUDA stream; on the CPU the engine waits before its sampler reads them) and the engine
reads the child's reply before the step's tokens (loom.structured.grammar_process,
loom.worker.stream_wait).

On the CPU the rows are not page-locked, so the engine waits where it takes them ("host"); the
"deferred" cases make the shared rows count as page-locked, so that the rows are returned before
the child has written them and the reply is read by ``await_rows``, as on a GPU (the host then
waits for it before its sampler reads them)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.call_counter import CallCounter
from helpers.structured_engine import (
    JSON_SPEC,
    LONG,
    assert_faulted,
    ids,
    kill_child_and_finish,
    make_engine,
    mixed,
    request,
    run,
    start,
)

from loom import kernel_switches
from loom.engine.llm_engine import LLMEngine
from loom.engine.types import EngineOutput
from loom.structured.grammar_process import GrammarProcess
from loom.structured.shared_rows import SharedRows

pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> LLMEngine:
    """The driver in the engine's process, synchronous scheduling."""
    return make_engine(tiny_llama_dir, async_scheduling="off", grammar_process="off")


def _subject(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, mode: str, **overrides: Any) -> LLMEngine:
    monkeypatch.setattr(kernel_switches, "grammar_device_wait", True)
    if mode.startswith("deferred"):
        monkeypatch.setattr(SharedRows, "registered", property(lambda self: self.flag is not None))
    return make_engine(tiny_llama_dir, async_scheduling="on", grammar_process="on", **overrides)


class _EarlyReplies:
    """Each step's fill reply read at the start of the step, before the engine takes the rows (as
    reading the ready requests does when some are held, and a fast child has replied): the
    unwaited rows must carry it over, and :meth:`GrammarProcess.await_rows` then finds it instead
    of waiting for one that came already (which would wait forever). Counts the early replies."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        self.lost = 0
        admit, await_rows = LLMEngine._admit_constrained, GrammarProcess.await_rows
        early: dict[int, int] = {}  # id(process) -> the fill id whose reply was read early

        def admit_after_the_reply(engine: LLMEngine) -> list[EngineOutput]:
            process = engine._structured
            if isinstance(process, GrammarProcess) and process._layout is not None and process._fill_sent:
                deadline = time.monotonic() + 2.0
                while process._rows_reply is None and process._broken is None and time.monotonic() < deadline:
                    process._drain()
                if process._rows_reply is not None:
                    early[id(process)] = process._fill_id
                    self.count += 1
            return admit(engine)

        def checked_await(process: GrammarProcess) -> None:
            awaiting = process._awaiting
            if awaiting is not None and early.get(id(process)) == awaiting[0] and process._awaited_reply is None:
                self.lost += 1
                raise AssertionError("a fill's reply read before its rows were taken was lost")
            await_rows(process)

        monkeypatch.setattr(LLMEngine, "_admit_constrained", admit_after_the_reply)
        monkeypatch.setattr(GrammarProcess, "await_rows", checked_await)


@pytest.mark.parametrize("mode", ["host", "deferred", "deferred-early-replies"])
def test_signalled_fills_give_the_same_tokens(tiny_llama_dir: Path, reference: LLMEngine,
                                              monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    want = run(reference, mixed())
    early = _EarlyReplies(monkeypatch) if mode == "deferred-early-replies" else None
    subject = _subject(tiny_llama_dir, monkeypatch, mode)
    unwaited = CallCounter(monkeypatch, GrammarProcess, "_unwaited_rows")
    try:
        got = run(subject, mixed())
        grammars = subject._structured
        assert isinstance(grammars, GrammarProcess) and grammars.device_wait
        flag = grammars._rows.flag
        assert flag is not None and int(flag[0]) > 5  # the child signalled its fills
        assert int(flag[0]) == grammars._fill_id or int(flag[0]) == grammars._fill_id - 1
    finally:
        subject.close()
    assert {k: ids(v) for k, v in got.items()} == {k: ids(v) for k, v in want.items()}
    assert {k: v[-1].finish_reason for k, v in got.items()} == {k: v[-1].finish_reason for k, v in want.items()}
    # deferred: the rows went to the sampler before the child's reply was read
    assert unwaited.calls > 5 if mode.startswith("deferred") else unwaited.calls == 0
    if early is not None:
        assert early.count > 5 and early.lost == 0


@pytest.mark.parametrize("mode", ["host", "deferred"])
def test_a_fill_fault_and_the_process_dying_fail_only_their_requests(tiny_llama_dir: Path, reference: LLMEngine,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     mode: str) -> None:
    """A fill that fails in the child leaves its slot open (the flag is still set: the device goes
    on), and that request alone fails; the child dying while the engine waits for a signalled
    fill opens the step's rows and sets the flag from the engine's side, and its constrained
    requests fail while the plain one ends as it does without them."""
    want = run(reference, [request("json", JSON_SPEC, do_sample=True, seed=5), request("plain", None, new=24)])
    subject = _subject(tiny_llama_dir, monkeypatch, mode, fault_injection=True)
    try:
        outs = run(subject, [request("json", JSON_SPEC, do_sample=True, seed=5), request("inject-grammar-fill", LONG),
                             request("plain", None, new=12)])
        assert_faulted(outs[("inject-grammar-fill", 0)], LONG.field, "injected: a fill failed")
        assert ids(outs[("json", 0)]) == ids(want[("json", 0)])

        grammars = subject._structured
        assert isinstance(grammars, GrammarProcess) and grammars._proc is not None
        seen = start(subject, [request("long", LONG, n=2), request("plain", None, new=24)], 6)
        assert grammars.num_matched == 2
        kill_child_and_finish(subject, seen)
    finally:
        subject.close()
    for index in (0, 1):
        assert_faulted(seen[("long", index)], LONG.field, "the grammar process ended")
    assert ids(seen[("plain", 0)]) == ids(want[("plain", 0)])


def test_closing_with_a_signalled_fill_outstanding_releases_the_device(tiny_llama_dir: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A fill returned unwaited whose child never writes it (stopped, then closed): the engine opens
    its rows and sets the flag itself, so that a device waiting for it would go on."""
    subject = _subject(tiny_llama_dir, monkeypatch, "deferred")
    try:
        subject.add_request(request("long", LONG, n=2))
        grammars = subject._structured
        for _ in range(2000):  # (until its grammar has compiled and it decodes)
            subject.step()
            if grammars is not None and grammars.num_matched == 2 and subject.num_async_steps > 2:
                break
            grammars = subject._structured
            time.sleep(0.005)
        assert isinstance(grammars, GrammarProcess) and grammars._proc is not None and grammars.num_matched == 2
        seqs = [s for s in subject.scheduler.running if grammars.has_matcher(s)]
        grammars.await_rows()  # (nothing outstanding between steps on a host sampler)
        os.kill(grammars._proc.pid, signal.SIGSTOP)
        grammars.will_sample(seqs)
        rows = grammars.bitmask_rows(seqs)
        assert rows is not None and rows.ready is not None
        flag, fill_id = rows.ready
        assert int(flag[0]) < fill_id  # not written: the child is stopped
        grammars.close()
        assert int(flag[0]) == fill_id and bool((rows.tensor() == -1).all())
    finally:
        subject.close()
