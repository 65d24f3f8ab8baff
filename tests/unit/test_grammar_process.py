"""Structured output's matchers in a process of their own (loom.structured.grammar_process), through
the in-process engine (a random-weight Llama with SmolLM2's vocabulary): the same tokens as the
driver in the engine's process, with asynchronous scheduling (rows filled while the step before is
finished), synchronously and with speculation; refusals and aborts as there; a token refused after
its use, a row left open and the process dying each fail only their own requests; auto chooses it
where it pays."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers.call_counter import CallCounter
from helpers.structured_engine import (
    CHOICE,
    JSON_SPEC,
    LONG,
    REGEX,
    SCHEMA,
    assert_faulted,
    drafted,
    ids,
    kill_child_and_finish,
    make_engine,
    mixed,
    request,
    run,
    start,
    text,
)

from loom.config import ConfigError, EngineConfig
from loom.engine.llm_engine import LLMEngine
from loom.engine.types import FinishReason
from loom.frontend.tokenizer import Tokenizer
from loom.structured.driver import StructuredOutput
from loom.structured.grammar_process import GrammarProcess
from loom.structured.spec import GrammarSpec

jsonschema = pytest.importorskip("jsonschema")


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(tiny_llama_dir)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> LLMEngine:
    """The driver in the engine's process, synchronous scheduling."""
    return make_engine(tiny_llama_dir, async_scheduling="off", grammar_process="off")


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Any:
    """Asynchronous scheduling with the grammar process (auto chooses it), fault injection on."""
    subject = make_engine(tiny_llama_dir, async_scheduling="on", fault_injection=True)
    yield subject
    subject.close()


def test_the_same_tokens_as_the_driver_in_the_engines_process(engine: LLMEngine, reference: LLMEngine,
                                                              tok: Tokenizer) -> None:
    want = run(reference, mixed())
    got = run(engine, mixed())
    assert isinstance(engine._structured, GrammarProcess) and isinstance(reference._structured, StructuredOutput)
    assert {k: ids(v) for k, v in got.items()} == {k: ids(v) for k, v in want.items()}
    assert {k: v[-1].finish_reason for k, v in got.items()} == {k: v[-1].finish_reason for k, v in want.items()}
    for index in (0, 1):
        jsonschema.validate(json.loads(text(tok, got[("json", index)])), SCHEMA)
    assert engine.num_async_steps > 0  # constrained steps went in flight
    stats = engine.stats()  # the child's compile statistics
    assert stats.grammar_cache_queries == 4 and sum(stats.grammar_compile_buckets) == 3  # (REGEX twice)
    again = run(engine, [request("json", JSON_SPEC, n=2, do_sample=True, seed=5)])
    assert ids(again[("json", 1)]) == ids(want[("json", 1)])
    assert engine.stats().grammar_cache_hits >= 1
    engine.step()  # nothing left: the finished sequences are forgotten here and in the child
    assert engine._structured.num_matched == 0


def test_synchronous_scheduling_and_speculation_give_the_same_tokens(tiny_llama_dir: Path, reference: LLMEngine,
                                                                    tok: Tokenizer) -> None:
    """Without a step in flight the rows are asked for at once; with drafts, one row per draft."""
    reqs = [drafted(tok, "g", 40), drafted(tok, "p", 12, spec=None), *mixed()]
    want = run(reference, reqs)
    speculating = make_engine(tiny_llama_dir, async_scheduling="off", grammar_process="on", speculate=3)
    try:
        got = run(speculating, reqs)
        assert isinstance(speculating._structured, GrammarProcess)
    finally:
        speculating.close()
    assert {k: ids(v) for k, v in got.items()} == {k: ids(v) for k, v in want.items()}
    assert sum(o.num_draft_tokens for o in got[("g", 0)]) > 0  # the constrained request verified drafts


def test_aborted_while_compiling_and_bad_grammar_refused(engine: LLMEngine) -> None:
    spec = GrammarSpec("regex", "[a-z]{1,64}(,[a-z0-9]{1,16}){0,7}y", "parameters.constraint.regex")  # not cached
    engine.add_request(request("gone", spec))
    engine.abort("gone")
    assert engine.has_unfinished()  # held until its compile ends, then dropped
    outs = run(engine, [request("bad", GrammarSpec("ebnf", 'root ::= "a" | nope', "parameters.constraint.grammar"))])
    assert not engine.has_unfinished() and ("gone", 0) not in outs
    bad = outs[("bad", 0)][0]
    assert bad.finish_reason is FinishReason.ERROR and bad.rejection is not None
    assert (bad.rejection.status, bad.rejection.field) == ("INVALID_ARGUMENT", "parameters.constraint.grammar")


@pytest.mark.parametrize("how", ["accept", "fill"])
def test_a_fault_in_the_process_fails_its_request_alone(engine: LLMEngine, reference: LLMEngine, tok: Tokenizer,
                                                        how: str) -> None:
    """accept: the child refuses a token after the engine used it (learned with the next rows);
    fill: the child leaves a row open, so that sequence's next token is refused before its use.
    Either way that request fails with INTERNAL GRAMMAR_MATCHER_FAULT and the others end as they
    do without it."""
    want = run(reference, [request("json", JSON_SPEC, do_sample=True, seed=5), request("plain", None, new=12)])
    broken = f"inject-grammar-{how}"
    outs = run(engine, [request("json", JSON_SPEC, do_sample=True, seed=5), request(broken, LONG),
                        request("plain", None, new=12)])
    assert_faulted(outs[(broken, 0)], LONG.field, f"injected: a{'n' if how == 'accept' else ''} {how} failed")
    assert len(ids(outs[(broken, 0)])) < 30  # it stopped early
    for key in (("json", 0), ("plain", 0)):
        assert ids(outs[key]) == ids(want[key]) and outs[key][-1].finish_reason is want[key][-1].finish_reason


def test_the_process_dying_fails_its_requests_and_a_new_one_serves_the_next(engine: LLMEngine,
                                                                             reference: LLMEngine) -> None:
    want = run(reference, [request("plain", None, new=24), request("json", JSON_SPEC, do_sample=True, seed=5)])
    grammars = engine._structured
    assert isinstance(grammars, GrammarProcess) and grammars._proc is not None
    outs = start(engine, [request("long", LONG, n=2), request("plain", None, new=24)], 6)
    assert grammars.num_matched == 2
    kill_child_and_finish(engine, outs)
    for index in (0, 1):
        assert_faulted(outs[("long", index)], LONG.field, "the grammar process ended")
    assert ids(outs[("plain", 0)]) == ids(want[("plain", 0)])  # untouched
    after = run(engine, [request("json", JSON_SPEC, do_sample=True, seed=5)])  # a new child
    assert ids(after[("json", 0)]) == ids(want[("json", 0)])
    assert grammars._proc is not None and grammars._proc.poll() is None


def test_auto_runs_it_with_asynchronous_scheduling_on_one_shard(tiny_llama_dir: Path) -> None:
    sync = make_engine(tiny_llama_dir, async_scheduling="off")
    assert not sync._grammar_process_wanted()
    assert make_engine(tiny_llama_dir, async_scheduling="on")._grammar_process_wanted()
    assert not make_engine(tiny_llama_dir, async_scheduling="on", grammar_process="off")._grammar_process_wanted()
    with pytest.raises(ConfigError, match="--grammar-process must be auto, on or off; got 'yes'"):
        EngineConfig(model_id=str(tiny_llama_dir), grammar_process="yes")


def test_close_stops_the_child(tiny_llama_dir: Path) -> None:
    subject = make_engine(tiny_llama_dir, grammar_process="on")
    run(subject, [request("choice", CHOICE)])
    grammars = subject._structured
    assert isinstance(grammars, GrammarProcess) and grammars._proc is not None
    proc = grammars._proc
    subject.close()
    assert proc.poll() == 0


def test_wait_and_child_statistics_and_a_quiet_exit_when_the_engine_goes(tiny_llama_dir: Path) -> None:
    """The diagnostics scripts/profile_s1.py reports: every fill counted on the engine's side, the
    child's steps and their time, its full collections (none while serving: its start-up objects
    are frozen); and a child whose engine vanished without a close exits at once, cleanly."""
    subject = make_engine(tiny_llama_dir, grammar_process="on")
    try:
        run(subject, [request("long", LONG), request("choice", CHOICE)])
        grammars = subject._structured
        assert isinstance(grammars, GrammarProcess) and grammars._proc is not None
        waits = grammars.waits
        assert waits.fills >= 5 and 0 <= waits.waits <= waits.fills and waits.wait_s >= 0.0
        assert waits.max_wait_s <= waits.wait_s + 1e-9
        child = grammars.child_stats()
        assert child is not None and child.steps >= waits.fills and child.step_s > 0.0
        assert child.max_step_s <= child.step_s
        again = grammars.child_stats()
        assert again is not None and again.steps == child.steps  # asking is not a step
        proc = grammars._proc
        assert grammars._conn is not None
        grammars._conn.close()  # as if the engine's process had exited
        assert proc.wait(10) == 0
        grammars._proc = None
    finally:
        subject.close()


def test_a_burst_on_grammars_compiled_before_joins_the_step_it_arrived_for(tiny_llama_dir: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache hit in the child is ready at once, as in the engine's process: the engine waits for
    those answers (briefly), so a burst of such requests is prefilled in one step, not split over
    the step it arrived for and the next. (The wait's bound is raised here: on a loaded 2-core
    machine the child's answers can take longer than the 10 ms it allows while serving.)"""
    from loom.structured import grammar_process

    monkeypatch.setattr(grammar_process, "_CACHED_READY_WAIT_S", 2.0)
    subject = make_engine(tiny_llama_dir, grammar_process="on")
    try:
        run(subject, [request("first", JSON_SPEC)])  # compiled now, and known to be
        for i in range(8):
            subject.add_request(request(f"burst-{i}", JSON_SPEC if i % 2 else REGEX if i > 3 else CHOICE))
        grammars = subject._structured
        assert isinstance(grammars, GrammarProcess)
        subject.step()
        # REGEX and CHOICE were never compiled: those may still wait (or be ready, not yet taken)
        held = len(grammars._held)
        assert grammars.num_held == held + len(grammars._refused)  # ready, not yet taken: counted once
        assert all(r not in grammars._held for r in (f"burst-{i}" for i in (1, 3, 5, 7)))
        assert held <= 4
        run(subject, [])
        assert grammars.num_held == 0 and not grammars._held_keys
    finally:
        subject.close()


def test_a_request_is_waited_for_once_even_if_its_text_was_evicted_in_the_child(tiny_llama_dir: Path) -> None:
    """A text the engine remembers as compiled may have left the child's cache and compile for
    real: the engine waits for its answer at one take_ready only, not at every step after."""
    subject = make_engine(tiny_llama_dir, grammar_process="on")
    try:
        run(subject, [request("first", CHOICE)])  # the child is up and its vocabulary described
        grammars = subject._structured
        assert isinstance(grammars, GrammarProcess)
        slow = GrammarSpec("regex", "[a-z]{1,64}(,[a-z0-9]{1,16}){0,9}q", "parameters.constraint.regex")
        grammars._compiled[slow.key] = None  # remembered, but never compiled: as if evicted there
        timeouts: list[float | None] = []
        receive = grammars._recv

        def counted(timeout: float | None) -> Any:
            timeouts.append(timeout)
            return receive(timeout)

        grammars._recv = counted  # type: ignore[method-assign]
        subject.add_request(request("evicted", slow))
        grammars.take_ready()
        waits_first = sum(1 for t in timeouts if t)
        timeouts.clear()
        for _ in range(3):
            if not grammars._held:
                break
            grammars.take_ready()
        assert waits_first >= 1 and all(not t for t in timeouts)  # later looks only drain
        run(subject, [])
        assert not grammars._awaited and not grammars._held_keys
    finally:
        subject.close()


def test_a_burst_of_holds_goes_in_one_message_and_its_cache_hits_come_back_in_one(tiny_llama_dir: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The requests held since the engine last looked go to the child together when it next looks
    (one message, not one each), and the ones whose grammar the child has compiled come back in one
    answer: a burst of 64 was 64 messages each way, 2.9 ms on this project's VM."""
    from loom.structured import grammar_process

    monkeypatch.setattr(grammar_process, "_CACHED_READY_WAIT_S", 2.0)  # (a loaded 2-core machine)
    subject = make_engine(tiny_llama_dir, grammar_process="on")
    try:
        run(subject, [request("first", JSON_SPEC)])
        grammars = subject._structured
        assert isinstance(grammars, GrammarProcess)
        sent: list[tuple[Any, ...]] = []
        handled: list[tuple[Any, ...]] = []
        send, handle = grammars._send, grammars._handle

        def sending(msg: tuple[Any, ...]) -> None:
            sent.append(msg)
            send(msg)

        def handling(msg: tuple[Any, ...]) -> None:
            handled.append(msg)
            handle(msg)

        grammars._send = sending  # type: ignore[method-assign]
        grammars._handle = handling  # type: ignore[method-assign]
        burst = [f"burst-{i}" for i in range(6)]
        for rid in burst:
            subject.add_request(request(rid, JSON_SPEC))
        assert not sent  # held here until the engine looks
        ready, refused = grammars.take_ready()
        holds = [m for m in sent if m[0] in ("holds", "hold")]
        assert [m[0] for m in holds] == ["holds"] and [h[0] for h in holds[0][1]] == burst
        answers = [m[1] for m in handled if m[0] == "ready"]
        assert answers == [burst] and not refused
        assert sorted(seqs[0].request_id for seqs in ready) == burst
        for seqs in ready:
            subject.scheduler.add(seqs[0], seqs[1:])
        run(subject, [])
        subject.step()  # nothing left: the finished sequences are forgotten here and in the child
        assert grammars.num_held == 0 and grammars.num_matched == 0
    finally:
        subject.close()


@pytest.mark.parametrize("stage_before_rows", [True, False])
def test_staging_the_next_step_before_the_rows_gives_the_same_tokens(tiny_llama_dir: Path, reference: LLMEngine,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    stage_before_rows: bool) -> None:
    """LOOM_STAGE_BEFORE_ROWS (on by default): the next step's inputs are staged before the engine
    waits for the rows of the step before; its forward (whose pending rows take that step's tokens)
    is launched after that step's sampling, as with the switch off. The same tokens as the driver
    in the engine's process either way."""
    from loom import kernel_switches

    monkeypatch.setattr(kernel_switches, "stage_before_rows", stage_before_rows)
    want = run(reference, mixed())
    subject = make_engine(tiny_llama_dir, async_scheduling="on", grammar_process="on")
    staged = CallCounter(monkeypatch, subject.worker, "stage_forward")
    try:
        got = run(subject, mixed())
        assert isinstance(subject._structured, GrammarProcess) and subject._structured.waits.fills > 5
    finally:
        subject.close()
    assert {k: ids(v) for k, v in got.items()} == {k: ids(v) for k, v in want.items()}
    assert {k: v[-1].finish_reason for k, v in got.items()} == {k: v[-1].finish_reason for k, v in want.items()}
    # constrained steps were staged before their predecessor's rows (or never, switched off)
    assert staged.calls > 5 if stage_before_rows else staged.calls == 0


@pytest.mark.parametrize("processes", [1, 2])
def test_polling_for_the_next_step_gives_the_same_tokens(tiny_llama_dir: Path, reference: LLMEngine,
                                                        monkeypatch: pytest.MonkeyPatch, processes: int) -> None:
    """LOOM_GRAMMAR_SPIN_US=2000 (off by default): the engine's thread polls for the rows, the child for the next step's message, before blocking.
    The same tokens as the driver in the engine's process, with one grammar process or a group."""
    from loom import kernel_switches
    from loom.structured.grammar_group import GrammarProcessGroup

    monkeypatch.setattr(kernel_switches, "grammar_spin_us", 2000)
    want = run(reference, mixed())
    subject = make_engine(tiny_llama_dir, async_scheduling="on", grammar_process="on", grammar_processes=processes)
    try:
        got = run(subject, mixed())
        structured: Any = subject._structured
        children = structured.children if isinstance(structured, GrammarProcessGroup) else [structured]
        assert all(child.config.spin_us == 2000 for child in children)
        assert sum(child.waits.fills for child in children) > 5
    finally:
        subject.close()
    assert {k: ids(v) for k, v in got.items()} == {k: ids(v) for k, v in want.items()}
    assert {k: v[-1].finish_reason for k, v in got.items()} == {k: v[-1].finish_reason for k, v in want.items()}


def test_the_spin_switch_reads_microseconds_and_is_off_by_default() -> None:
    from loom import kernel_switches

    assert kernel_switches._grammar_spin_us("750") == 750 and kernel_switches._grammar_spin_us("0") == 0
    for bad in ("fast", "-1"):
        with pytest.raises(ValueError, match=f"LOOM_GRAMMAR_SPIN_US='{bad}': expected"):
            kernel_switches._grammar_spin_us(bad)
    assert kernel_switches._grammar_spin_us("") == 0 and kernel_switches._grammar_spin_us(" ") == 0


def test_a_bad_spin_value_is_refused_before_anything_loads(monkeypatch: pytest.MonkeyPatch,
                                                           tiny_llama_dir: Path) -> None:
    """A bad LOOM_GRAMMAR_SPIN_US does not fail the import (a traceback wherever it is first
    imported): the preflight of loom serve / bench and the engine refuse it in one sentence."""
    from loom import kernel_switches
    from loom.config import ConfigError, EngineConfig
    from loom.engine.llm_engine import LLMEngine
    from loom.preflight import check_engine_config

    monkeypatch.setenv("LOOM_GRAMMAR_SPIN_US", "fast")
    assert kernel_switches._spin_or_off() == 0
    config = EngineConfig(model_id=str(tiny_llama_dir), device="cpu")
    for refuse in (check_engine_config, LLMEngine):
        with pytest.raises(ConfigError, match="LOOM_GRAMMAR_SPIN_US='fast': expected a whole number"):
            refuse(config)


def test_spin_until_readable_returns_on_a_message_or_after_its_time() -> None:
    import socket
    import time
    from multiprocessing.connection import Connection

    from loom.structured.grammar_process import spin_until_readable

    a, b = socket.socketpair()
    ours, theirs = Connection(a.detach()), Connection(b.detach())
    started = time.perf_counter()
    assert not spin_until_readable(ours, 0.005)
    assert time.perf_counter() - started >= 0.005
    theirs.send_bytes(b"step")
    assert spin_until_readable(ours, 10.0) and ours.recv_bytes() == b"step"
    ours.close()
    theirs.close()
