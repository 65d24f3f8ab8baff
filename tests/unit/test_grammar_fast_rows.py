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
    """The plain path, the fast path filled on the engine's thread, and the fast path filled on
    the fill thread (the engine's order: the next step's rows are queued before this step's
    tokens are accepted, and sequences finish after the fill started): the same rows."""
    compiler, vocab, eos = pool
    fast = StructuredOutput(compiler, vocab, eos, compile_timeout_s=60, fast_rows=True, fill_thread=False)
    plain = StructuredOutput(compiler, vocab, eos, compile_timeout_s=60, fast_rows=False)
    ahead = StructuredOutput(compiler, vocab, eos, compile_timeout_s=60, fast_rows=True, fill_thread=True)
    drivers = [fast, plain, ahead]
    rng = random.Random(seed)
    seqs: list[Sequence] = []
    leader: dict[int, Sequence] = {}  # a copy follows its leader's tokens while both live
    count = 0

    def add(spec: GrammarSpec, follow: Sequence | None = None) -> None:
        nonlocal count
        seq = new_seq(f"r{count}", spec, rng.choice([0, 0, 3]))
        count += 1
        admit(drivers, seq, spec)
        seqs.append(seq)
        if follow is not None:
            leader[seq.seq_id] = follow

    def next_batch(step: int) -> tuple[list[Sequence], Sequence]:
        other = new_seq(f"u{step}", SPECS[0], 0)  # a row without a grammar, somewhere in the batch
        batch = list(seqs)
        batch.insert(rng.randrange(len(batch) + 1), other)
        return batch, other

    for i in range(12):
        add(SPECS[i % len(SPECS)])
    for i in range(6):  # identical twins: one state, one fill on the fast path
        add(SPECS[i % len(SPECS)], follow=seqs[i])
    plain_rows = constrained_steps = shared = ended = lagging = filled_ahead = late = 0
    batch, other = next_batch(0)
    for _step in range(40):
        filled_ahead += ahead._ahead is not None and ahead._ahead.seqs is batch
        a, b, c = fast.bitmask_rows(batch), plain.bitmask_rows(batch), ahead.bitmask_rows(batch)
        assert a is not None and b is not None and c is not None
        assert a.rows == b.rows and a.to_bytes() == b.to_bytes(), f"step {_step}: masks differ"
        assert c.rows == b.rows and c.to_bytes() == b.to_bytes(), f"step {_step}: masks filled ahead differ"
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
        # The engine launches the next step before it accepts this one's tokens: the sequences
        # finished before this step leave, new ones join, and the next rows are queued.
        for seq in [s for s in seqs if s.is_finished]:  # its open row was compared above
            seqs.remove(seq)
            add(rng.choice(SPECS))
        batch, other = next_batch(_step + 1)
        ahead.queue_rows(batch)
        want = plain.accept_step(items)
        assert fast.accept_step(items) == want and ahead.accept_step(items) == want
        for seq in seqs:
            assert fast.terminated(seq) == plain.terminated(seq) == ahead.terminated(seq)
            entry = fast._matchers.get(seq.seq_id)  # None: finished, and forgotten by a later admission
            if entry is not None and entry.pending:  # in step with another matcher, which accepted for it
                lagging += 1
            elif entry is not None:
                assert entry.terminated == entry.matcher.is_terminated()
            if not seq.is_finished and (fast.terminated(seq) or rng.random() < 0.03):  # ended by EOS, or aborted
                ended += fast.terminated(seq)
                late += seq in batch  # finished while its next row is being filled ahead
                seq.status = SequenceStatus.FINISHED
    # every branch met: shared states, matchers ended by EOS, open rows of finished sequences,
    # matchers whose tokens another accepted (caught up when they part or fill alone), rows
    # filled ahead, and sequences that finished after their next row's fill had started
    assert constrained_steps == 40 and plain_rows > 40 * 12 and shared > 10 and ended > 3 and lagging > 10, (
        plain_rows, shared, ended, lagging)
    assert filled_ahead == 39 and late > 3, (filled_ahead, late)


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


def test_a_token_refused_on_the_fill_thread_fails_its_request_at_the_next_accept(
        pool: tuple[GrammarCompilerPool, int, tuple[int, ...]]) -> None:
    """With rows queued for the fill thread, a step's tokens (but stop tokens) are accepted there:
    a token the grammar refuses (only a fault of ours can sample one) is answered by the next
    accept_step, and its row in between is left open; the other rows are those of the plain path."""
    compiler, vocab, eos = pool
    ahead = StructuredOutput(compiler, vocab, eos, compile_timeout_s=60, fast_rows=True, fill_thread=True)
    plain = StructuredOutput(compiler, vocab, eos, compile_timeout_s=60, fast_rows=False)
    seqs = [new_seq(f"y{i}", SPECS[1], 0) for i in range(4)]
    for seq in seqs:
        admit([ahead, plain], seq, SPECS[1])
    a, z = 81, 106  # "a"; "z", which the regex [a-c]{1,6} refuses
    items = [(seqs[0], [a]), (seqs[1], [z]), (seqs[2], [a]), (seqs[3], [a])]
    batch = list(seqs)
    ahead.queue_rows(batch)
    assert ahead.accept_step(items) == {}  # accepted on the thread: not known yet
    want = plain.accept_step(items)
    assert list(want) == [seqs[1].seq_id]
    rows = ahead.bitmask_rows(batch)
    assert rows is not None and ahead.num_filled_ahead == 1
    mask = rows.tensor()
    assert bool((mask[1] == -1).all())  # the refused row is left open
    good = [s for i, s in enumerate(seqs) if i != 1]
    expect = plain.bitmask_rows(good)
    assert expect is not None and mask[[0, 2, 3]].numpy().tobytes() == expect.to_bytes()
    got = ahead.accept_step([(s, [a]) for s in good] + [(seqs[1], [a])])
    assert list(got) == [seqs[1].seq_id] and got[seqs[1].seq_id] == want[seqs[1].seq_id]
    assert got[seqs[1].seq_id].rejection.reason == "GRAMMAR_TOKEN_REJECTED"
