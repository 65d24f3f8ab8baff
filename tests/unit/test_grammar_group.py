"""Structured output's matchers split over two grammar processes (loom.structured.grammar_group),
through the in-process engine (a random-weight Llama with SmolLM2's vocabulary): requests spread
over both, each writing its rows at the slots the engine assigns in one shared mapping; the same
tokens as the driver in the engine's process, with asynchronous and synchronous scheduling, with
speculation (draft rows) and with the fast rows switched off; a fault or a dead process fails only
its own requests; the setting is checked."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.structured_engine import (
    CHOICE,
    DRAFTED,
    JSON_SPEC,
    LONG,
    REGEX,
    SCHEMA,
    assert_faulted,
    drafted,
    ids,
    make_engine,
    request,
    run,
    text,
)
from helpers.structured_engine import mixed as shared_mixed

from loom.config import ConfigError, EngineConfig
from loom.engine.llm_engine import LLMEngine
from loom.engine.types import EngineOutput, EngineRequest
from loom.frontend.tokenizer import Tokenizer
from loom.structured.grammar_group import GrammarProcessGroup
from loom.structured.spec import GrammarSpec

jsonschema = pytest.importorskip("jsonschema")


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(tiny_llama_dir)


def mixed() -> list[EngineRequest]:
    """The grammar-process tests' requests and two more of four grammars in all: spread over the
    two processes, rows of both in most steps."""
    return [*shared_mixed(), request("long", LONG), request("json2", JSON_SPEC)]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> LLMEngine:
    """The driver in the engine's process, synchronous scheduling."""
    return make_engine(tiny_llama_dir, async_scheduling="off", grammar_process="off")


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Any:
    """Asynchronous scheduling with two grammar processes, fault injection on."""
    subject = make_engine(tiny_llama_dir, async_scheduling="on", grammar_processes=2, fault_injection=True)
    yield subject
    subject.close()


def holders(group: GrammarProcessGroup) -> list[set[str]]:
    """The requests each child matched (sequences running with a matcher there), by request id."""
    return [{seq.request_id for seq, child in group._matched.values() if child is c} for c in group.children]


def warmed_group(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> tuple[GrammarProcessGroup, list[int]]:
    """``engine``'s group with both children's compilers up and the test's grammars compiled in
    both (so that a burst is ready in one step, rows of both children in its steps), and a count
    of the steps whose rows both children filled."""
    from loom.structured import grammar_process

    monkeypatch.setattr(grammar_process, "_CACHED_READY_WAIT_S", 2.0)  # (a loaded 2-core machine)
    for spec in (CHOICE, JSON_SPEC, REGEX, LONG):
        run(engine, [request("warm-a", spec, new=2), request("warm-b", spec, new=2)])
    group = engine._structured_output()
    assert isinstance(group, GrammarProcessGroup)
    shared = [0]
    original = group.bitmask_rows

    def counting(seqs: Any, drafts: Any = None) -> Any:
        if group._step is not None and len(group._step[3]) == 2:
            shared[0] += 1
        return original(seqs, drafts)

    monkeypatch.setattr(group, "bitmask_rows", counting)
    return group, shared


def test_requests_spread_over_both_give_the_drivers_tokens(engine: LLMEngine, reference: LLMEngine,
                                                           tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    want = run(reference, mixed())
    group, shared = warmed_group(engine, monkeypatch)
    queries = engine.stats().grammar_cache_queries
    outs: dict[tuple[str, int], list[EngineOutput]] = {}
    for r in mixed():
        engine.add_request(r)
    spread: list[set[str]] = [set(), set()]  # the requests each child matched, over the run
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault((out.request_id, out.index), []).append(out)
        for seen, now in zip(spread, holders(group), strict=True):
            seen |= now
    assert all(len(s) >= 2 for s in spread) and not spread[0] & spread[1], spread
    assert {k: ids(v) for k, v in outs.items()} == {k: ids(v) for k, v in want.items()}
    assert shared[0] >= 5  # steps with rows of both children, placed in one block
    assert {k: v[-1].finish_reason for k, v in outs.items()} == {k: v[-1].finish_reason for k, v in want.items()}
    for key in (("json", 0), ("json", 1), ("json2", 0)):
        jsonschema.validate(json.loads(text(tok, outs[key])), SCHEMA)
    assert engine.num_async_steps > 0
    assert engine.stats().grammar_cache_queries == queries + 6  # the children's compile statistics, summed
    engine.step()  # nothing left: the finished sequences are forgotten here and in the children
    assert group.num_matched == 0 and all(c.num_matched == 0 for c in group.children)


@pytest.mark.parametrize("fast_rows", [True, False])
def test_synchronous_scheduling_speculation_and_the_plain_rows_give_the_same_tokens(
        tiny_llama_dir: Path, reference: LLMEngine, tok: Tokenizer, monkeypatch: pytest.MonkeyPatch,
        fast_rows: bool) -> None:
    """Without a step in flight the rows are asked for at once; with drafts, one row per draft,
    each process copying its block of rows to its slots; with LOOM_GRAMMAR_FAST_ROWS=0 (read by
    the children) every row takes that copy."""
    if not fast_rows:
        monkeypatch.setenv("LOOM_GRAMMAR_FAST_ROWS", "0")
    reqs = [drafted(tok, "g", 40), drafted(tok, "p", 12, spec=None), drafted(tok, "g2", 30), *mixed()]
    want = run(reference, reqs)
    speculating = make_engine(tiny_llama_dir, async_scheduling="off", grammar_process="on", grammar_processes=2,
                              speculate=3)
    try:
        run(speculating, [request("warm-a", DRAFTED, new=2), request("warm-b", DRAFTED, new=2)])
        _, shared = warmed_group(speculating, monkeypatch)
        got = run(speculating, reqs)
    finally:
        speculating.close()
    assert {k: ids(v) for k, v in got.items()} == {k: ids(v) for k, v in want.items()}
    assert shared[0] >= 3  # steps with rows (and draft rows) of both children
    assert sum(o.num_draft_tokens for o in got[("g", 0)]) > 0  # the constrained requests verified drafts
    assert sum(o.num_draft_tokens for o in got[("g2", 0)]) > 0


@pytest.mark.parametrize("how", ["accept", "fill"])
def test_a_fault_in_one_process_fails_its_request_alone(engine: LLMEngine, reference: LLMEngine, how: str) -> None:
    want = run(reference, [request("json", JSON_SPEC, do_sample=True, seed=5), request("plain", None, new=12),
                           request("choice", CHOICE)])
    broken = f"inject-grammar-{how}"
    outs = run(engine, [request("json", JSON_SPEC, do_sample=True, seed=5), request(broken, LONG),
                        request("plain", None, new=12), request("choice", CHOICE)])
    assert_faulted(outs[(broken, 0)], LONG.field, f"injected: a{'n' if how == 'accept' else ''} {how} failed")
    for key in (("json", 0), ("plain", 0), ("choice", 0)):
        assert ids(outs[key]) == ids(want[key]) and outs[key][-1].finish_reason is want[key][-1].finish_reason


def test_a_process_dying_fails_its_requests_alone_and_a_new_one_serves_the_next(engine: LLMEngine,
                                                                               reference: LLMEngine) -> None:
    other = GrammarSpec("regex", "(ab|ba|a|b){31,40}", "parameters.constraint.regex")  # a text new here
    want = run(reference, [request("plain", None, new=24), request("again", LONG), request("other", other)])
    run(engine, [request("w1", CHOICE, new=2), request("w2", REGEX, new=2)])  # both children's compilers up
    group = engine._structured_output()
    assert isinstance(group, GrammarProcessGroup)
    for r in (request("long", LONG, n=2), request("other", other), request("plain", None, new=24)):
        engine.add_request(r)
    outs: dict[tuple[str, int], list[EngineOutput]] = {}
    deadline = time.monotonic() + 60
    while group.num_matched < 3 and time.monotonic() < deadline:  # both compiled (a first one describes the vocabulary)
        for out in engine.step():
            outs.setdefault((out.request_id, out.index), []).append(out)
    spread = holders(group)
    assert sorted(spread, key=sorted) == [{"long"}, {"other"}], spread  # a new text: the least loaded child
    dying = group.children[spread.index({"long"})]
    assert dying._proc is not None
    dying._proc.kill()
    dying._proc.wait()
    for key, more in run(engine, []).items():
        outs.setdefault(key, []).extend(more)
    for index in (0, 1):
        assert_faulted(outs[("long", index)], LONG.field, "the grammar process ended")
    assert ids(outs[("other", 0)]) == ids(want[("other", 0)])  # the other child's request went on
    assert ids(outs[("plain", 0)]) == ids(want[("plain", 0)])
    after = run(engine, [request("again", LONG)])  # to the text's home: the child that died, started again
    assert ids(after[("again", 0)]) == ids(want[("again", 0)])
    assert dying._proc is not None and dying._proc.poll() is None
    engine.step()  # nothing left: the dead child's sequences are forgotten here too
    assert group.num_matched == 0


def test_the_setting_is_checked_and_one_process_is_no_group(tiny_llama_dir: Path) -> None:
    with pytest.raises(ConfigError, match="--grammar-processes must be 1 to 16, got 0"):
        EngineConfig(model_id=str(tiny_llama_dir), grammar_processes=0)
    subject = make_engine(tiny_llama_dir, grammar_process="on")
    try:
        run(subject, [request("choice", CHOICE)])
        assert not isinstance(subject._structured, GrammarProcessGroup)
    finally:
        subject.close()
    with pytest.raises(ValueError, match="at least 2"):
        GrammarProcessGroup(None, 1)  # type: ignore[arg-type]


def test_a_grammar_text_stays_in_its_home_child_until_that_holds_too_many_more(tiny_llama_dir: Path) -> None:
    """Requests of one text go to the child it went to first (shared cache, shared rows of
    matchers in the same state) while that child holds at most 8 sequences more than the least
    loaded; past that, to the least loaded. A new text goes to the least loaded child."""
    subject = make_engine(tiny_llama_dir, async_scheduling="on", grammar_processes=2)
    try:
        group = subject._structured_output()
        assert isinstance(group, GrammarProcessGroup)
        for i in range(12):
            subject.add_request(request(f"a{i}", LONG))
        subject.add_request(request("b", REGEX))
        first, second = group.children
        assert [first.load, second.load] == [10, 3]
        # a0-a8 at home; a9 overflows (9 > 0 + 8); a10 home again (9 <= 1 + 8); a11 over; b: least loaded
        assert set(first._held) == {f"a{i}" for i in (*range(9), 10)} and set(second._held) == {"a9", "a11", "b"}
        assert group._homes == {LONG.key: first, REGEX.key: second}
    finally:
        subject.close()
