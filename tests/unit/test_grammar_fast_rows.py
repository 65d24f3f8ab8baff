"""The structured-output driver's fast path (the default) against its plain path
(``LOOM_GRAMMAR_FAST_ROWS=0``) on random token streams: the same bitmask rows byte for byte, the
same refusals, the same terminated matchers, step after step. The streams share prefixes (rows
in one state share one fill on the fast path), end by EOS, finish mid-run and have
min_new_tokens, so every branch of the fast path meets its plain twin."""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.broken_matchers import BrokenMatchers

from loom.engine.sequence import Sequence, SequenceStatus
from loom.engine.types import EngineRequest, SamplingParams, StoppingParams
from loom.sample.batch import TokenBitmaskRows, token_bitmask
from loom.structured.compiler_pool import GrammarCompilerPool
from loom.structured.driver import StructuredOutput
from loom.structured.grammars import choice_to_ebnf
from loom.structured.spec import GrammarSpec
from loom.worker.staging import Stager

xg = pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"},
    "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "color": {"enum": ["red", "green", "blue"]},
    "name": {"type": "string", "maxLength": 6},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
}, "required": ["ok", "n", "color"]}
SPECS = [GrammarSpec("json_schema", json.dumps(SCHEMA), "parameters.constraint.json_schema"),
         GrammarSpec("regex", "[a-c]{1,6}", "parameters.constraint.regex"),
         GrammarSpec("ebnf", choice_to_ebnf(["yes", "no", "maybe"]), "parameters.constraint.choice")]


@pytest.fixture(scope="module")
def pool(default_model_dir: Path) -> tuple[GrammarCompilerPool, int, tuple[int, ...]]:
    """A compiler with SmolLM2's real vocabulary (49,152 tokens)."""
    from loom.model_loader import eos_token_ids, load_hf_config, model_dims
    from loom.structured.vocabulary import vocabulary_from_model_dir

    vocab = model_dims(load_hf_config(default_model_dir)).vocab_size
    eos = eos_token_ids(default_model_dir)
    return GrammarCompilerPool(lambda: vocabulary_from_model_dir(default_model_dir, vocab, eos), workers=1), vocab, eos


def new_seq(rid: str, spec: GrammarSpec, min_new: int) -> Sequence:
    seq = Sequence(EngineRequest(rid, (1, 2, 3), SamplingParams(constraint=spec),
                                 StoppingParams(max_new_tokens=64, min_new_tokens=min_new)), 0, None)
    seq.status = SequenceStatus.RUNNING
    return seq


def admit(drivers: list[StructuredOutput], seq: Sequence, spec: GrammarSpec) -> None:
    for driver in drivers:
        driver.hold(seq.request_id, spec, [seq])
        while not driver.take_ready()[0]:
            pass


def allowed_tokens(mask: torch.Tensor, vocab: int) -> np.ndarray:
    """[W] int32 row -> the token ids whose bit is set."""
    bits = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


@pytest.mark.parametrize("seed", [0, 1])
def test_fast_rows_equal_the_plain_path_on_random_streams(
        pool: tuple[GrammarCompilerPool, int, tuple[int, ...]], seed: int) -> None:
    compiler, vocab, eos = pool
    fast = StructuredOutput(compiler, vocab, eos, compile_timeout_s=60, fast_rows=True)
    plain = StructuredOutput(compiler, vocab, eos, compile_timeout_s=60, fast_rows=False)
    rng = random.Random(seed)
    seqs: list[Sequence] = []
    leader: dict[int, Sequence] = {}  # a copy follows its leader's tokens while both live
    count = 0

    def add(spec: GrammarSpec, follow: Sequence | None = None) -> None:
        nonlocal count
        seq = new_seq(f"r{count}", spec, rng.choice([0, 0, 3]))
        count += 1
        admit([fast, plain], seq, spec)
        seqs.append(seq)
        if follow is not None:
            leader[seq.seq_id] = follow

    for i in range(12):
        add(SPECS[i % len(SPECS)])
    for i in range(6):  # identical twins: one state, one fill on the fast path
        add(SPECS[i % len(SPECS)], follow=seqs[i])
    plain_rows = constrained_steps = shared = ended = lagging = 0
    for _step in range(40):
        other = new_seq(f"u{_step}", SPECS[0], 0)  # a row without a grammar, somewhere in the batch
        batch = list(seqs)
        batch.insert(rng.randrange(len(batch) + 1), other)
        a, b = fast.bitmask_rows(batch), plain.bitmask_rows(batch)
        assert a is not None and b is not None
        assert a.rows == b.rows and a.to_bytes() == b.to_bytes(), f"step {_step}: masks differ"
        constrained_steps += 1
        plain_rows += len(b.rows)
        states = [fast._matchers[s.seq_id].state for s in seqs if not s.is_finished and s.seq_id in fast._matchers]
        shared += len(states) - len(set(states))  # rows the fast path copied instead of filling
        mask = a.tensor()
        chosen: dict[int, int] = {}
        row_of = {r: g for g, r in enumerate(a.rows)}
        assert batch.index(other) not in row_of
        for i, seq in enumerate(batch):
            if seq is other or seq.is_finished:
                continue
            g = row_of[i]
            follow = leader.get(seq.seq_id)
            if follow is not None and follow.seq_id in chosen:
                chosen[seq.seq_id] = chosen[follow.seq_id]
                continue
            ids = allowed_tokens(mask[g], vocab)
            ends = [t for t in ids.tolist() if t in eos]
            chosen[seq.seq_id] = ends[0] if ends and rng.random() < 0.3 else int(rng.choice(ids.tolist()))
        items = [(s, [chosen[s.seq_id]]) for s in seqs if not s.is_finished]
        for seq, (token,) in items:
            seq.token_ids.append(token)
        assert fast.accept_step(items) == plain.accept_step(items)
        gone = [s for s in seqs if s.is_finished]  # finished last step: its open row was compared above
        for seq in seqs:
            assert fast.terminated(seq) == plain.terminated(seq)
            entry = fast._matchers.get(seq.seq_id)  # None: finished, and forgotten by a later admission
            if entry is not None and entry.pending:  # in step with another matcher, which accepted for it
                lagging += 1
            elif entry is not None:
                assert entry.terminated == entry.matcher.is_terminated()
            if not seq.is_finished and (fast.terminated(seq) or rng.random() < 0.03):  # ended by EOS, or aborted
                ended += fast.terminated(seq)
                seq.status = SequenceStatus.FINISHED
        for seq in gone:
            seqs.remove(seq)
            add(rng.choice(SPECS))
    # every branch met: shared states, matchers ended by EOS, open rows of finished sequences,
    # matchers whose tokens another accepted (caught up when they part or fill alone)
    assert constrained_steps == 40 and plain_rows > 40 * 12 and shared > 10 and ended > 3 and lagging > 10, (
        plain_rows, shared, ended, lagging)


def test_a_refused_token_in_a_batch_is_refused_on_both_paths(
        pool: tuple[GrammarCompilerPool, int, tuple[int, ...]]) -> None:
    compiler, vocab, eos = pool
    fast = StructuredOutput(compiler, vocab, eos, compile_timeout_s=60, fast_rows=True)
    plain = StructuredOutput(compiler, vocab, eos, compile_timeout_s=60, fast_rows=False)
    seqs = [new_seq(f"x{i}", SPECS[1], 0) for i in range(4)]
    for seq in seqs:
        admit([fast, plain], seq, SPECS[1])
    a = 81  # "a" in SmolLM2's vocabulary
    z = 106  # "z": the regex [a-c]{1,6} refuses it
    items = [(seqs[0], [a]), (seqs[1], [z]), (seqs[2], [a]), (seqs[3], [a])]
    got, want = fast.accept_step(items), plain.accept_step(items)
    assert got == want and list(got) == [seqs[1].seq_id]
    assert got[seqs[1].seq_id].rejection.reason == "GRAMMAR_TOKEN_REJECTED"


def test_token_bitmask_rows_pickle_as_bytes_and_every_row_stages_no_indices() -> None:
    data = torch.randint(-2**31, 2**31 - 1, (3, 5), dtype=torch.int32)
    rows = TokenBitmaskRows([0, 1, 2], 5, data)
    back = pickle.loads(pickle.dumps(rows))
    assert isinstance(back.data, bytes) and back == rows and torch.equal(back.tensor(), data)
    stage = Stager(torch.device("cpu"))
    every = token_bitmask(rows, stage, num_rows=3)
    assert every.rows is None  # masks rows 0..2 in order without reading indices
    some = token_bitmask(TokenBitmaskRows([0, 2], 5, data[:2]), stage, num_rows=3)
    assert some.rows is not None and some.rows.tolist() == [0, 2]
    logits = torch.randn(3, 5 * 32)
    assert torch.equal(every(logits.clone()), token_bitmask(rows, stage)(logits.clone()))


def test_a_matcher_out_of_step_fails_its_request_alone(pool: tuple[GrammarCompilerPool, int, tuple[int, ...]]) -> None:
    """Two sequences in one state: the second's matcher takes the token the first accepted as
    pending. If it then refuses that token (a fault: the same state and token must give the same
    state), its rows are left open, the other sequence's row is still filled (it takes the
    state's fill), and its next accept refuses that request alone with INTERNAL; nothing raises."""
    compiler, vocab, eos = pool
    driver = StructuredOutput(compiler, vocab, eos, compile_timeout_s=60, fast_rows=True)
    lead, lagging = new_seq("lead", SPECS[1], 0), new_seq("lagging", SPECS[1], 0)
    for seq in (lead, lagging):
        admit([driver], seq, SPECS[1])
    a, z = 81, 106  # "a" and "z": the regex [a-c]{1,6} takes the first, refuses the second
    for seq in (lead, lagging):
        seq.token_ids.append(a)
    assert driver.accept_step([(lead, [a]), (lagging, [a])]) == {}
    entry = driver._matchers[lagging.seq_id]
    assert entry.pending == [a]  # the lead accepted for it
    entry.pending[:] = [z]  # out of step: its matcher will refuse the token it must catch up on

    rows = driver.bitmask_rows([lagging, lead])
    assert rows is not None and rows.rows == [0, 1]
    mask = rows.tensor()
    assert bool((mask[0] == -1).all())  # open: sample anything, the accept refuses it
    reference = xg.GrammarMatcher(compiler.compile(SPECS[1]).result(), override_stop_tokens=list(eos))
    assert reference.accept_token(a)
    allowed = allowed_tokens(mask[1], vocab).tolist()  # the lead's row: filled, as a fresh matcher's
    assert a in allowed and z not in allowed
    assert allowed == allowed_tokens(_fill(reference, driver.words), vocab).tolist()

    for seq in (lead, lagging):
        seq.token_ids.append(a)
    refusals = driver.accept_step([(lagging, [a]), (lead, [a])])
    assert list(refusals) == [lagging.seq_id]
    rejection = refusals[lagging.seq_id].rejection
    assert (rejection.status, rejection.reason) == ("INTERNAL", "GRAMMAR_MATCHER_FAULT")
    assert "refused token 106" in refusals[lagging.seq_id].message
    assert driver.bitmask_rows([lead]) is not None  # the other sequence goes on


def _step_tokens(rows: TokenBitmaskRows, seqs: list[Sequence], vocab: int, eos: tuple[int, ...],
                 rng: random.Random, twins: dict[int, int]) -> list[tuple[Sequence, list[int]]]:
    """A token for each of ``seqs`` (all constrained and live) that its row allows, never EOS;
    ``twins`` maps an index to the earlier one whose token it repeats (one state, one token)."""
    mask = rows.tensor()
    chosen: list[int] = []
    for i in range(len(seqs)):
        ids = [t for t in allowed_tokens(mask[i], vocab).tolist() if t not in eos]
        chosen.append(chosen[twins[i]] if i in twins else rng.choice(ids))
    for seq, token in zip(seqs, chosen, strict=True):
        seq.token_ids.append(token)
    return [(seq, [token]) for seq, token in zip(seqs, chosen, strict=True)]


def _faulted_drivers(pool: tuple[GrammarCompilerPool, int, tuple[int, ...]], fast: bool
                     ) -> tuple[StructuredOutput, StructuredOutput, list[Sequence]]:
    """A driver and its reference, the same five sequences in both: JSON, a regex twice (twins:
    one state while they take the same tokens), an EBNF grammar with min_new_tokens, JSON again
    (grammars that last longer than the tests' steps)."""
    compiler, vocab, eos = pool
    under, reference = (StructuredOutput(compiler, vocab, eos, compile_timeout_s=60, fast_rows=fast) for _ in range(2))
    regex = GrammarSpec("regex", "[a-c]{1,200}", "parameters.constraint.regex")
    words = GrammarSpec("ebnf", 'root ::= ("yes" | "no") (" " ("yes" | "no"))*', "parameters.constraint.grammar")
    specs, mins = [SPECS[0], regex, regex, words, SPECS[0]], [0, 0, 0, 4, 0]
    seqs = [new_seq(f"s{i}", spec, m) for i, (spec, m) in enumerate(zip(specs, mins, strict=True))]
    for seq, spec in zip(seqs, specs, strict=True):
        admit([under, reference], seq, spec)
    return under, reference, seqs


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "plain"])
def test_a_batch_fill_that_raises_for_one_row_fills_every_other_row(
        pool: tuple[GrammarCompilerPool, int, tuple[int, ...]], fast: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """xgrammar raises in the batch fill for one matcher: the rows are filled one by one, the
    other rows as the reference fills them (the broken one's twin, whose row copied it on the
    fast path, fills in its place), the broken row is left open, and the next accept fails that
    request alone with INTERNAL GRAMMAR_MATCHER_FAULT; nothing raises."""
    _, vocab, eos = pool
    under, reference, seqs = _faulted_drivers(pool, fast)
    broken = BrokenMatchers(monkeypatch)
    rng, twins = random.Random(7), {2: 1}
    for _ in range(2):  # a few tokens in: the twins share a state, one fill on the fast path
        rows = reference.bitmask_rows(seqs)
        assert rows is not None and under.bitmask_rows(seqs) == rows
        items = _step_tokens(rows, seqs, vocab, eos, rng, twins)
        assert under.accept_step(items) == {} and reference.accept_step(items) == {}
    culprit = seqs[1]
    broken.break_(under, culprit, fill=True)
    got, want = under.bitmask_rows(seqs), reference.bitmask_rows(seqs)
    assert broken.batch_fills == 1  # the batch call raised
    assert got is not None and want is not None and got.rows == want.rows
    got_t, want_t = got.tensor(), want.tensor()
    for g in range(len(seqs)):
        if g == 1:
            assert bool((got_t[g] == -1).all())  # open: its accept fails the request
        else:
            assert torch.equal(got_t[g], want_t[g]), f"row {g} differs from the reference"
    items = _step_tokens(want, seqs, vocab, eos, rng, twins)
    refusals = under.accept_step(items)
    assert reference.accept_step(items) == {}
    assert list(refusals) == [culprit.seq_id]
    refusal = refusals[culprit.seq_id]
    assert (refusal.rejection.status, refusal.rejection.reason) == ("INTERNAL", "GRAMMAR_MATCHER_FAULT")
    assert refusal.rejection.field == "parameters.constraint.regex"
    assert "raised RuntimeError: injected: the matcher's fill failed while filling its mask" in refusal.message
    culprit.status = SequenceStatus.FINISHED  # the engine fails its request
    rest = [s for s in seqs if s is not culprit]
    for _ in range(2):  # the others go on, as in the reference
        rows = reference.bitmask_rows(rest)
        assert rows is not None and under.bitmask_rows(rest) == rows
        items = _step_tokens(rows, rest, vocab, eos, rng, {})
        assert under.accept_step(items) == {} and reference.accept_step(items) == {}


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "plain"])
def test_a_batch_accept_that_raises_for_one_row_accepts_every_other_row(
        pool: tuple[GrammarCompilerPool, int, tuple[int, ...]], fast: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """xgrammar raises in the batch accept for one matcher, after its loop took the tokens of the
    rows before it: those are not accepted twice (read from each matcher's history), the rows
    after it accept one by one, the broken one's twin (whose matcher lagged: the broken one had
    accepted for it) catches up and accepts, and the broken one's request alone is refused with
    INTERNAL GRAMMAR_MATCHER_FAULT; the masks stay the reference's after."""
    _, vocab, eos = pool
    under, reference, seqs = _faulted_drivers(pool, fast)
    broken = BrokenMatchers(monkeypatch)
    rng, twins = random.Random(3), {2: 1}
    rows = reference.bitmask_rows(seqs)
    assert rows is not None and under.bitmask_rows(seqs) == rows
    items = _step_tokens(rows, seqs, vocab, eos, rng, twins)
    assert under.accept_step(items) == {} and reference.accept_step(items) == {}
    culprit = seqs[1]
    if fast:
        assert under._matchers[seqs[2].seq_id].pending  # the culprit accepts for its twin
    broken.break_(under, culprit, accept=True)
    rows = reference.bitmask_rows(seqs)
    assert rows is not None and under.bitmask_rows(seqs) == rows
    items = _step_tokens(rows, seqs, vocab, eos, rng, twins)
    refusals = under.accept_step(items)
    assert broken.batch_accepts == 1  # the batch call raised, after the first row's token
    assert reference.accept_step(items) == {}
    assert list(refusals) == [culprit.seq_id]
    refusal = refusals[culprit.seq_id]
    assert (refusal.rejection.status, refusal.rejection.reason) == ("INTERNAL", "GRAMMAR_MATCHER_FAULT")
    assert (f"raised RuntimeError: injected: the matcher's accept failed while accepting token {items[1][1][0]}"
            in refusal.message)
    culprit.status = SequenceStatus.FINISHED  # the engine fails its request
    rest = [s for s in seqs if s is not culprit]
    for _ in range(3):  # the others go on, as in the reference: no token taken twice, none missed
        rows = reference.bitmask_rows(rest)
        assert rows is not None and under.bitmask_rows(rest) == rows
        items = _step_tokens(rows, rest, vocab, eos, rng, {})
        assert under.accept_step(items) == {} and reference.accept_step(items) == {}


def test_a_draft_walk_that_raises_opens_that_sequences_rows_alone(
        pool: tuple[GrammarCompilerPool, int, tuple[int, ...]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A sequence verifying drafts whose matcher raises while walking them: its rows are left
    open and its next accept fails its request alone; the other sequences' rows (drafted or
    not) are the reference's."""
    _, vocab, eos = pool
    under, reference, seqs = _faulted_drivers(pool, fast=True)
    broken = BrokenMatchers(monkeypatch)
    rng = random.Random(5)
    rows = reference.bitmask_rows(seqs)
    assert rows is not None
    items = _step_tokens(rows, seqs, vocab, eos, rng, {})
    assert under.accept_step(items) == {} and reference.accept_step(items) == {}
    a, b, c = 81, 82, 83  # "a", "b", "c": the regex takes them
    drafts = [[], [a, b], [c], [], []]  # the culprit (1) and its twin (2) verify drafts
    culprit = seqs[1]
    broken.break_(under, culprit, fill=True)
    got, want = under.bitmask_rows(seqs, drafts), reference.bitmask_rows(seqs, drafts)
    assert got is not None and want is not None and got.rows == want.rows == list(range(8))
    got_t, want_t = got.tensor(), want.tensor()
    for g in range(8):
        if g in (1, 2, 3):  # the culprit's three rows
            assert bool((got_t[g] == -1).all())
        else:
            assert torch.equal(got_t[g], want_t[g]), f"row {g} differs from the reference"
    rows = reference.bitmask_rows(seqs)  # each sequence's first row (a fill moves no matcher)
    assert rows is not None
    items = _step_tokens(rows, seqs, vocab, eos, rng, {})
    assert reference.accept_step(items) == {}
    refusals = under.accept_step(items)
    assert list(refusals) == [culprit.seq_id]
    assert refusals[culprit.seq_id].rejection.reason == "GRAMMAR_MATCHER_FAULT"
    assert "while walking its 2 draft tokens" in refusals[culprit.seq_id].message


def _fill(matcher: object, words: int) -> torch.Tensor:
    row = torch.zeros(1, words, dtype=torch.int32)
    matcher.fill_next_token_bitmask(row, 0)  # type: ignore[attr-defined]
    return row[0]
