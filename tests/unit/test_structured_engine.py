"""Structured output through the in-process engine (a random-weight Llama with SmolLM2's
vocabulary): outputs that end by EOS match their constraint, n > 1 and seeds, min_new_tokens,
constrained logprobs, async scheduling, aborts while compiling, and rows without a grammar exactly
as they are alone."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
from helpers.broken_matchers import BrokenMatchers
from helpers.structured_engine import assert_faulted, ids, request, run, text

from loom.config import EngineConfig
from loom.engine.llm_engine import LLMEngine
from loom.engine.sequence import Sequence
from loom.engine.types import EngineOutput, EngineRequest, FinishReason, SamplingParams, StoppingParams
from loom.frontend.tokenizer import Tokenizer
from loom.structured.driver import StructuredOutput
from loom.structured.grammars import choice_to_ebnf
from loom.structured.spec import GrammarSpec

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"},
    "n": {"type": "integer", "minimum": 0, "maximum": 9},
    "color": {"enum": ["red", "green"]},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
}, "required": ["ok", "n", "color"]}
JSON_SPEC = GrammarSpec("json_schema", json.dumps(SCHEMA), "parameters.constraint.json_schema")
REGEX = GrammarSpec("regex", "[a-c]{2,4}", "parameters.constraint.regex")
CHOICE = GrammarSpec("ebnf", choice_to_ebnf(["yes", "no", "maybe"]), "parameters.constraint.choice")


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(tiny_llama_dir)


def make_engine(model_dir: Path, **overrides: Any) -> LLMEngine:
    """The driver in the engine's process unless told otherwise (on CUDA auto would start the
    grammar process, which tests/unit/test_grammar_process.py covers): the fault tests patch it."""
    overrides.setdefault("grammar_process", "off")
    return LLMEngine(EngineConfig(model_id=str(model_dir), max_batch_total_tokens=4096, warmup=False, **overrides))





def finish(outs: list[EngineOutput]) -> FinishReason | None:
    return outs[-1].finish_reason



@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> LLMEngine:
    return make_engine(tiny_llama_dir)


def test_constrained_outputs_match_and_unconstrained_rows_are_untouched(engine: LLMEngine, tok: Tokenizer) -> None:
    plain_alone = run(engine, [request("plain", None, new=12)])[("plain", 0)]
    mixed = run(engine, [
        request("json", JSON_SPEC, n=2, do_sample=True, seed=5),
        request("regex", REGEX, do_sample=True, seed=1),
        request("choice", CHOICE),
        request("plain", None, new=12),
    ])
    assert ids(mixed[("plain", 0)]) == ids(plain_alone)  # the mask touched only its rows
    # Same tokens; logprobs within float32 rounding, not bit-equal: the CPU GEMMs of a 5-row and a
    # 1-row batch reduce in different orders (CI measured a 1e-6 difference at step 11). The
    # sampler-level test (test_token_bitmask) checks the unmasked row bit for bit.
    mixed_lp = [lp for o in mixed[("plain", 0)] for lp in o.logprobs]
    alone_lp = [lp for o in plain_alone for lp in o.logprobs]
    assert mixed_lp == pytest.approx(alone_lp, abs=1e-5)
    for index in (0, 1):
        outs = mixed[("json", index)]
        assert finish(outs) is FinishReason.EOS_TOKEN, text(tok, outs)
        assert ids(outs)[-1] in engine.eos_token_ids
        jsonschema.validate(json.loads(text(tok, outs)), SCHEMA)
    assert ids(mixed[("json", 0)]) != ids(mixed[("json", 1)])  # each completion its own seed and matcher
    assert re.fullmatch("[a-c]{2,4}", text(tok, mixed[("regex", 0)]))
    assert finish(mixed[("regex", 0)]) is FinishReason.EOS_TOKEN
    assert text(tok, mixed[("choice", 0)]) in ("yes", "no", "maybe")
    stats = engine.stats()
    assert stats.grammar_cache_queries == 3 and sum(stats.grammar_compile_buckets) >= 3
    # seeded: the same tokens again, alone this time, from the compile cache
    again = run(engine, [request("json", JSON_SPEC, n=2, do_sample=True, seed=5)])
    assert ids(again[("json", 1)]) == ids(mixed[("json", 1)])
    assert engine.stats().grammar_cache_hits >= 1


def test_random_weights_would_not_match_without_the_grammar(engine: LLMEngine, tok: Tokenizer) -> None:
    free = run(engine, [request("free", None, new=12, do_sample=True, seed=1)])[("free", 0)]
    assert not re.fullmatch("[a-c]{2,4}", text(tok, free))  # the test above is not passing by luck


def test_min_new_tokens_waits_unless_the_grammar_can_only_end(engine: LLMEngine, tok: Tokenizer) -> None:
    outs = run(engine, [
        request("short", GrammarSpec("regex", "[a-c]{1,100}"), min_new=6, do_sample=True, seed=3),
        request("done", GrammarSpec("ebnf", 'root ::= "ok"'), min_new=10),
    ])
    short = outs[("short", 0)]
    assert finish(short) is FinishReason.EOS_TOKEN and len(ids(short)) >= 7  # 6 tokens, then EOS
    assert re.fullmatch("[a-c]{1,100}", text(tok, short))
    done = outs[("done", 0)]
    assert finish(done) is FinishReason.EOS_TOKEN and text(tok, done) == "ok"  # the grammar wins
    assert len(ids(done)) < 10


def test_logprobs_are_those_of_the_constrained_distribution(engine: LLMEngine, tok: Tokenizer) -> None:
    outs = run(engine, [request("c", CHOICE, new=4, top_n_tokens=5), request("u", None, new=1, top_n_tokens=5)])
    first_c, first_u = outs[("c", 0)][0], outs[("u", 0)][0]
    token = first_c.token_ids[0]
    unconstrained = dict(first_u.top_tokens[0]) if first_u.top_tokens else {}
    # renormalised over the few allowed tokens: more likely than among the whole vocabulary
    assert first_c.logprobs[0] > unconstrained.get(token, -1e9)
    assert first_c.top_tokens is not None
    top = first_c.top_tokens[0]
    assert token in [t for t, _ in top]
    # alternatives are only tokens the grammar allows here: each starts one of the choices
    assert all(any(c.startswith(tok.token_text(t)) for c in ("yes", "no", "maybe")) for t, _ in top), top
    assert sum(math.exp(lp) for _, lp in top) <= 1.0 + 1e-4


@pytest.mark.parametrize("grammar_process", ["off", "on"])
def test_async_scheduling_gives_the_same_outputs(tiny_llama_dir: Path, engine: LLMEngine, grammar_process: str) -> None:
    """Constrained steps stay asynchronous: the forward is queued, the previous step's tokens are
    read back, and only then are the grammar rows filled and the sampling queued (off), or the rows
    are filled in the grammar process meanwhile and the sampling is queued at the next launch (on).
    A completion whose grammar ends (the choice) has one row too many in the next step, dropped."""
    reqs = [request("json", JSON_SPEC, do_sample=True, seed=9), request("plain", None, new=10, do_sample=True, seed=2),
            request("regex", REGEX, n=2, do_sample=True, seed=4), request("choice", CHOICE),
            request("min", REGEX, min_new=3)]
    sync = run(engine, reqs)
    overlapped = make_engine(tiny_llama_dir, async_scheduling="on", grammar_process=grammar_process)
    forced = run(overlapped, reqs)
    assert {k: ids(v) for k, v in forced.items()} == {k: ids(v) for k, v in sync.items()}
    assert forced[("choice", 0)][-1].finish_reason is FinishReason.EOS_TOKEN
    before = overlapped.num_async_steps  # constrained requests alone (their grammar is cached now)
    again = run(overlapped, [request("again", REGEX, n=2, do_sample=True, seed=4)])
    assert overlapped.num_async_steps > before
    assert [ids(again[("again", i)]) for i in range(2)] == [ids(sync[("regex", i)]) for i in range(2)]
    overlapped.close()


def test_aborted_while_compiling_and_bad_grammar_refused(engine: LLMEngine) -> None:
    spec = GrammarSpec("regex", "[a-z]{1,64}(,[a-z0-9]{1,16}){0,8}x", "parameters.constraint.regex")  # not cached
    engine.add_request(request("gone", spec))
    engine.abort("gone")
    assert engine.has_unfinished()  # held until its compile ends, then dropped
    outs = run(engine, [request("bad", GrammarSpec("ebnf", 'root ::= "a" | nope', "parameters.constraint.grammar"))])
    assert not engine.has_unfinished() and ("gone", 0) not in outs
    bad = outs[("bad", 0)][0]
    assert bad.finish_reason is FinishReason.ERROR and bad.rejection is not None
    assert (bad.rejection.status, bad.rejection.field) == ("INVALID_ARGUMENT", "parameters.constraint.grammar")


def test_speculation_drafts_are_masked_per_row_and_change_no_token(tiny_llama_dir: Path, engine: LLMEngine,
                                                                  tok: Tokenizer) -> None:
    spec = GrammarSpec("regex", "(ab|ba|a|b){4,40}", "parameters.constraint.regex")
    prompt = tuple(tok.encode("ab ab ab ab ab ab ab ab ab ab"))  # n-gram drafts come from repeats
    reqs = [EngineRequest("g", prompt, SamplingParams(constraint=spec), StoppingParams(max_new_tokens=40)),
            EngineRequest("p", prompt, SamplingParams(), StoppingParams(max_new_tokens=12, ignore_eos=True))]
    plain = run(engine, reqs)
    speculating = make_engine(tiny_llama_dir, speculate=3)
    drafted = run(speculating, reqs)
    assert {k: ids(v) for k, v in drafted.items()} == {k: ids(v) for k, v in plain.items()}
    assert sum(o.num_draft_tokens for o in drafted[("g", 0)]) > 0  # the constrained request verified drafts
    assert re.fullmatch("(ab|ba|a|b){4,40}", text(tok, drafted[("g", 0)])) or finish(drafted[("g", 0)]) is not \
        FinishReason.EOS_TOKEN


def test_finished_matchers_are_dropped_when_constrained_traffic_stops(engine: LLMEngine) -> None:
    """A finished sequence's matcher goes at the next step even when no constrained request is
    waiting for its grammar (it used to stay until the next constrained request arrived)."""
    run(engine, [request("json", JSON_SPEC, n=2, do_sample=True, seed=3), request("plain", None, new=4)])
    run(engine, [request("plain-after", None, new=2)])  # steps with nothing held
    assert engine._structured is not None and engine._structured.num_matched == 0


def _break_on_attach(monkeypatch: pytest.MonkeyPatch, request_id: str, *, fill: bool = False,
                     accept: bool = False) -> BrokenMatchers:
    """The matchers of ``request_id`` raise (on fill and/or accept, alone and in xgrammar's batch
    calls) from the moment its grammar is ready."""
    broken = BrokenMatchers(monkeypatch)
    attach = StructuredOutput._attach

    def attach_broken(self: StructuredOutput, seqs: list[Sequence], compiled: Any, spec: GrammarSpec) -> None:
        attach(self, seqs, compiled, spec)
        for seq in seqs:
            if seq.request_id == request_id:
                broken.break_(self, seq, fill=fill, accept=accept)

    monkeypatch.setattr(StructuredOutput, "_attach", attach_broken)
    return broken



@pytest.mark.parametrize("how", ["fill", "accept"])
def test_a_matcher_that_raises_fails_its_request_alone(engine: LLMEngine, tok: Tokenizer,
                                                       monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """xgrammar raises for one request's matcher (filling its mask, or accepting its token) in a
    batch with two other constrained requests (one before it, one after) and an unconstrained
    one: that request fails with INTERNAL GRAMMAR_MATCHER_FAULT, the others end with valid
    outputs (the plain one token for token as alone), and no step raises."""
    plain_alone = run(engine, [request("plain", None, new=12)])[("plain", 0)]
    broken = _break_on_attach(monkeypatch, "broken", fill=how == "fill", accept=how == "accept")
    outs = run(engine, [
        request("json", JSON_SPEC, do_sample=True, seed=5),
        request("broken", REGEX, do_sample=True, seed=1),
        request("choice", CHOICE),
        request("plain", None, new=12),
    ])
    assert (broken.batch_fills, broken.batch_accepts) == ((1, 0) if how == "fill" else (0, 1))
    doing = "while filling its mask" if how == "fill" else "while accepting token"
    assert_faulted(outs[("broken", 0)], REGEX.field, "the grammar's matcher raised RuntimeError: injected", doing)
    assert finish(outs[("json", 0)]) is FinishReason.EOS_TOKEN
    jsonschema.validate(json.loads(text(tok, outs[("json", 0)])), SCHEMA)
    assert finish(outs[("choice", 0)]) is FinishReason.EOS_TOKEN
    assert text(tok, outs[("choice", 0)]) in ("yes", "no", "maybe")
    assert ids(outs[("plain", 0)]) == ids(plain_alone) and finish(outs[("plain", 0)]) is FinishReason.LENGTH


@pytest.mark.parametrize("scheduling", ["sync", "async"])
@pytest.mark.parametrize("where", ["bitmask_rows", "accept_step"])
def test_a_grammar_fault_outside_xgrammar_fails_the_constrained_requests_of_the_step(
        tiny_llama_dir: Path, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, scheduling: str, where: str) -> None:
    """The engine's backstop: when the driver itself raises (a bug outside xgrammar) filling the
    rows (the step is then sampled without a mask) or accepting the tokens, the step's
    constrained requests fail with INTERNAL GRAMMAR_MATCHER_FAULT, the unconstrained one ends as
    it does alone, and engine.step() never raises."""
    plain_alone = run(engine, [request("plain", None, new=12)])[("plain", 0)]
    subject = engine if scheduling == "sync" else make_engine(tiny_llama_dir, async_scheduling="on")

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"injected: a bug in {where}")

    monkeypatch.setattr(StructuredOutput, where, boom)
    outs = run(subject, [request("json", JSON_SPEC, n=2, do_sample=True, seed=5), request("regex", REGEX),
                         request("plain", None, new=12)])
    doing = "while filling this step's token masks" if where == "bitmask_rows" else "while accepting this step's tokens"
    for key, field in [(("json", 0), JSON_SPEC.field), (("json", 1), JSON_SPEC.field), (("regex", 0), REGEX.field)]:
        assert_faulted(outs[key], field, doing, f"RuntimeError: injected: a bug in {where}")
    assert ids(outs[("plain", 0)]) == ids(plain_alone) and finish(outs[("plain", 0)]) is FinishReason.LENGTH
    assert not subject.has_unfinished()
