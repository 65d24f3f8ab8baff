"""The compile pool (off the caller's thread, cached, bounded, timed) and the engine-side driver
(held requests, one matcher per completion, bitmask rows, min_new_tokens, dead ends), on a
vocabulary of single ASCII characters so that every text can be spelled and compiles are fast."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest

from loom.engine.sequence import Sequence
from loom.engine.types import EngineRequest, SamplingParams, StoppingParams
from loom.sample.processors import unpack_bitmask
from loom.structured.compiler_pool import COMPILE_TIME_BUCKETS, GrammarCompilerPool
from loom.structured.driver import StructuredOutput
from loom.structured.grammars import GrammarError
from loom.structured.spec import GrammarSpec
from loom.structured.vocabulary import VocabularyError, describe_vocabulary

xg = pytest.importorskip("xgrammar")

VOCAB = ["<s>", "</s>", *(chr(c) for c in range(32, 127)), "yes", "no"]
EOS = 1
YES_NO = GrammarSpec("regex", "(yes|no)", "parameters.constraint.regex")


def tiny_vocabulary() -> Any:
    return xg.TokenizerInfo(VOCAB, xg.VocabType.RAW, vocab_size=len(VOCAB), stop_token_ids=[EOS])


def tok(text: str) -> int:
    return VOCAB.index(text)


class GatedPool(GrammarCompilerPool):
    """A pool whose compiles wait for ``gate`` (a slow compile, on demand)."""

    def __init__(self, **kwargs: Any) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()
        super().__init__(tiny_vocabulary, **kwargs)

    def _compile(self, compiler: Any, spec: GrammarSpec) -> Any:
        self.started.set()
        assert self.gate.wait(30)
        return super()._compile(compiler, spec)


def wait(future: Future[Any]) -> Any:
    return future.result(timeout=30)


def test_compiles_on_a_worker_and_caches_by_text() -> None:
    pool = GrammarCompilerPool(tiny_vocabulary)
    caller = threading.get_ident()
    seen: list[int] = []
    original = pool._compile
    pool._compile = lambda c, s: (seen.append(threading.get_ident()), original(c, s))[1]  # type: ignore[method-assign]
    first = pool.compile(YES_NO)
    compiled = wait(first)
    assert seen and seen[0] != caller  # compiled on a pool thread, not the caller's (the step loop)
    assert isinstance(compiled, xg.CompiledGrammar)
    again = pool.compile(GrammarSpec("regex", "(yes|no)", "another.field"))  # same text: same entry
    assert again is first and wait(again) is compiled
    other = pool.compile(GrammarSpec("regex", "(yes|maybe)"))
    assert other is not first and wait(other) is not compiled
    stats = pool.snapshot()
    assert (stats.queries, stats.hits, stats.compiles, stats.failures) == (3, 1, 2, 0)
    assert sum(stats.buckets) == 2 and len(stats.buckets) == len(COMPILE_TIME_BUCKETS) + 1
    assert 0 < stats.seconds_sum < 30


def test_a_text_being_compiled_is_shared_and_failures_stay_cached() -> None:
    pool = GatedPool()
    a = pool.compile(YES_NO)
    b = pool.compile(YES_NO)
    assert pool.started.wait(30) and a is b and not a.done()  # one compile for both requests
    pool.gate.set()
    wait(a)
    bad = GrammarSpec("regex", "(unclosed")
    with pytest.raises(GrammarError, match="parenthesis"):
        wait(pool.compile(bad))
    with pytest.raises(GrammarError):
        wait(pool.compile(bad))  # refused again from the cache
    assert pool.snapshot().failures == 1 and pool.snapshot().compiles == 2


def test_the_cache_is_bounded_by_compiled_size_least_recent_first() -> None:
    pool = GrammarCompilerPool(tiny_vocabulary, cache_bytes=0)
    keep = pool.compile(YES_NO)
    wait(keep)
    assert len(pool) == 0 and pool.cached_bytes == 0  # over the bound at once: evicted, still returned
    pool = GrammarCompilerPool(tiny_vocabulary, cache_bytes=1 << 30)
    specs = [GrammarSpec("regex", f"(a|b){{{i}}}") for i in range(1, 4)]
    sizes = [wait(pool.compile(s)).memory_size_bytes for s in specs]
    assert len(pool) == 3 and pool.cached_bytes == sum(sizes)
    pool.compile(specs[0])  # used again: now the most recent
    pool.cache_bytes = sizes[0] + sizes[2]
    wait(pool.compile(GrammarSpec("regex", "z")))  # a fourth entry: the oldest unused ones go
    assert pool.compile(specs[0]).done() and pool.snapshot().hits == 2
    assert pool.compile(specs[1]) is not None and len(pool) <= 3


def test_a_vocabulary_that_cannot_be_described_fails_every_compile() -> None:
    def broken() -> Any:
        raise VocabularyError("no vocabulary here")

    pool = GrammarCompilerPool(broken)
    with pytest.raises(VocabularyError, match="no vocabulary here"):
        wait(pool.compile(YES_NO))
    assert pool.ready_at is not None

    class NoVocab:  # not a transformers tokenizer at all
        pass

    with pytest.raises(VocabularyError, match="cannot describe"):
        describe_vocabulary(NoVocab(), 10, [1])
    with pytest.raises(VocabularyError, match="no EOS token"):
        describe_vocabulary(NoVocab(), 10, [])


# -- the driver ---------------------------------------------------------------------------------------


def seqs_of(request_id: str, spec: GrammarSpec | None, n: int = 1, min_new: int = 0) -> list[Sequence]:
    req = EngineRequest(request_id, (0,), SamplingParams(constraint=spec), StoppingParams(max_new_tokens=8,
                                                                                           min_new_tokens=min_new), n=n)
    return [Sequence(req, i, None) for i in range(n)]


def ready(driver: StructuredOutput, timeout: float = 30) -> tuple[list[list[Sequence]], list[Any]]:
    deadline = time.monotonic() + timeout
    while True:
        got = driver.take_ready()
        if got[0] or got[1] or time.monotonic() > deadline:
            return got
        time.sleep(0.005)


def allowed(mask: Any, row: int) -> set[str]:
    bits = unpack_bitmask(mask.tensor()[row : row + 1], len(VOCAB))[0]
    return {VOCAB[i] for i in bits.nonzero().flatten().tolist()}


def test_driver_holds_a_request_until_compiled_then_one_matcher_per_completion() -> None:
    pool = GatedPool()
    driver = StructuredOutput(pool, len(VOCAB), (EOS,), compile_timeout_s=30)
    seqs = seqs_of("r", YES_NO, n=2)
    driver.hold("r", YES_NO, seqs)
    assert driver.take_ready() == ([], []) and driver.num_held == 1  # still compiling: not schedulable
    pool.gate.set()
    got, refused = ready(driver)
    assert got == [seqs] and refused == [] and driver.num_held == 0
    plain = seqs_of("p", None)[0]
    mask = driver.bitmask_rows([seqs[0], plain, seqs[1]])
    assert mask is not None and mask.rows == [0, 2]
    assert allowed(mask, 0) == allowed(mask, 1) == {"y", "n", "yes", "no"}
    assert driver.bitmask_rows([plain]) is None  # no grammar: no processor
    # each completion follows its own tokens
    assert driver.accept(seqs[0], tok("yes")) is None and driver.accept(seqs[1], tok("n")) is None
    seqs[1].token_ids.append(tok("n"))
    mask = driver.bitmask_rows(seqs)
    assert mask is not None and mask.rows == [0, 1]
    assert allowed(mask, 0) == {"</s>"} and allowed(mask, 1) == {"o"}
    assert not driver.terminated(seqs[0])
    assert driver.accept(seqs[0], EOS) is None and driver.terminated(seqs[0])
    refusal = driver.accept(seqs[1], tok("x"))  # a token its mask did not allow
    assert refusal is not None and refusal.rejection.status == "INTERNAL"


def test_min_new_tokens_holds_eos_back_unless_the_grammar_can_only_end() -> None:
    driver = StructuredOutput(GrammarCompilerPool(tiny_vocabulary), len(VOCAB), (EOS,), compile_timeout_s=30)
    spec = GrammarSpec("regex", "a+")
    seq = seqs_of("m", spec, min_new=3)[0]
    driver.hold("m", spec, [seq])
    assert ready(driver)[0] == [[seq]]
    driver.accept(seq, tok("a"))
    seq.token_ids.append(tok("a"))
    mask = driver.bitmask_rows([seq])
    assert mask is not None and allowed(mask, 0) == {"a"}  # EOS would be allowed without min_new_tokens
    seq.token_ids += [tok("a")] * 2
    mask = driver.bitmask_rows([seq])
    assert mask is not None and allowed(mask, 0) == {"a", "</s>"}
    choice = GrammarSpec("ebnf", 'root ::= "no"')
    seq2 = seqs_of("c", choice, min_new=5)[0]
    driver.hold("c", choice, [seq2])
    assert ready(driver)[0] == [[seq2]]
    driver.accept(seq2, tok("no"))
    seq2.token_ids.append(tok("no"))
    mask = driver.bitmask_rows([seq2])
    assert mask is not None and allowed(mask, 0) == {"</s>"}  # complete: the grammar wins


def test_a_grammar_the_vocabulary_cannot_spell_is_a_dead_end() -> None:
    driver = StructuredOutput(GrammarCompilerPool(tiny_vocabulary), len(VOCAB), (EOS,), compile_timeout_s=30)
    spec = GrammarSpec("regex", "é", "parameters.constraint.regex")  # no ASCII token spells it
    seq = seqs_of("d", spec)[0]
    driver.hold("d", spec, [seq])
    assert ready(driver)[0] == [[seq]]
    mask = driver.bitmask_rows([seq])
    assert mask is not None and len(allowed(mask, 0)) == len(VOCAB)  # left unmasked: nothing to sample
    refusal = driver.accept(seq, tok("a"))
    assert refusal is not None and refusal.rejection.status == "FAILED_PRECONDITION"
    assert refusal.rejection.field == "parameters.constraint.regex" and "no token" in refusal.message


def test_time_limit_refuses_and_the_same_text_is_refused_at_once_while_it_compiles() -> None:
    pool = GatedPool()
    now = [100.0]
    driver = StructuredOutput(pool, len(VOCAB), (EOS,), compile_timeout_s=2.0, clock=lambda: now[0])
    spec = GrammarSpec("json_schema", '{"type": "integer"}', "parameters.constraint.json_schema")
    driver.hold("slow", spec, seqs_of("slow", spec))
    assert pool.started.wait(30)  # the vocabulary is described: the time limit runs from here
    assert driver.take_ready() == ([], [])
    now[0] += 1.5
    assert driver.take_ready() == ([], [])
    now[0] += 1.0
    _, refused = driver.take_ready()
    assert [r.request_id for r in refused] == ["slow"]
    r = refused[0].rejection
    assert (r.status, r.field, r.reason) == ("INVALID_ARGUMENT", "parameters.constraint.json_schema",
                                             "GRAMMAR_COMPILE_TIMEOUT")
    assert "--grammar-compile-timeout (2 s)" in refused[0].message
    driver.hold("again", spec, seqs_of("again", spec))  # no new clock time needed
    assert [x.request_id for x in driver.take_ready()[1]] == ["again"]
    assert pool.snapshot().timeouts == 2
    pool.gate.set()  # the compile ends after all: the text is cached for later requests
    wait(pool.compile(spec))
    driver.hold("later", spec, seqs_of("later", spec))
    assert [s[0].request_id for s in driver.take_ready()[0]] == ["later"]


def test_requests_aborted_while_held_are_dropped_and_finished_matchers_forgotten() -> None:
    pool = GatedPool()
    driver = StructuredOutput(pool, len(VOCAB), (EOS,), compile_timeout_s=30)
    seqs = seqs_of("a", YES_NO)
    driver.hold("a", YES_NO, seqs)
    from loom.engine.sequence import SequenceStatus

    seqs[0].status = SequenceStatus.FINISHED  # what LLMEngine.abort does to a held request
    pool.gate.set()
    wait(pool.compile(YES_NO))
    assert driver.take_ready() == ([], []) and driver.num_held == 0
    live = seqs_of("b", YES_NO)
    driver.hold("b", YES_NO, live)
    assert ready(driver)[0] == [live] and driver.has_matcher(live[0])
    live[0].status = SequenceStatus.FINISHED
    driver.take_ready()
    assert not driver.has_matcher(live[0])


def test_draft_rows_get_the_mask_after_the_drafts_and_the_matcher_rolls_back() -> None:
    driver = StructuredOutput(GrammarCompilerPool(tiny_vocabulary), len(VOCAB), (EOS,), compile_timeout_s=30)
    seqs = seqs_of("s", YES_NO, n=2)
    driver.hold("s", YES_NO, seqs)
    assert ready(driver)[0] == [seqs]
    plain = seqs_of("p", None)[0]
    # seq 0 verifies drafts "y", "e"; the plain sequence one draft; seq 1 a draft the grammar refuses
    mask = driver.bitmask_rows([seqs[0], plain, seqs[1]], [[tok("y"), tok("e")], [tok("q")], [tok("x"), tok("e")]])
    assert mask is not None and mask.rows == [0, 1, 2, 5, 6, 7]  # plain's rows 3 and 4 untouched
    assert allowed(mask, 0) == {"y", "n", "yes", "no"}
    assert allowed(mask, 1) == {"e"} and allowed(mask, 2) == {"s"}  # after "y", after "ye"
    assert allowed(mask, 3) == {"y", "n", "yes", "no"}
    assert len(allowed(mask, 4)) == len(allowed(mask, 5)) == len(VOCAB)  # past "x": verification stops there
    again = driver.bitmask_rows([seqs[0]])  # the walk was rolled back
    assert again is not None and allowed(again, 0) == {"y", "n", "yes", "no"}
    assert driver.accept_tokens(seqs[0], [tok("y"), tok("e"), tok("s"), EOS, tok("x")]) is None
    assert driver.terminated(seqs[0])  # stopped at the EOS that ended the grammar
