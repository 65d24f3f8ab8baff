"""Host work of structured output per engine step, at 64 constrained rows (S1's shape), on the CPU.

Builds the engine's :class:`loom.structured.driver.StructuredOutput` with real xgrammar, the
bundled SmolLM2's vocabulary and S1's eight JSON schemas (``loom.bench.structured.SCHEMAS``),
then times, step after step, exactly the calls the engine makes for a constrained step:

- ``any_matched`` (the engine's launch, and again the output processor's),
- ``bitmask_rows`` (the step's rows, filled on the host while the forward runs),
- ``token_bitmask`` (the worker turns the rows into the processor; on the CPU nothing is staged),
- ``accept_step`` and ``terminated`` on EOS (the output processor's, the step's tokens).

Each of the 64 sequences follows a valid JSON document of its schema (request i: schema i % 8),
tokenised by SmolLM2's tokenizer and ended by EOS, started at staggered offsets; a sequence that
ends is replaced by a new request of the same schema (between timed steps), as continuous
batching does. The masks are checked to allow each next token, and their bytes are hashed
(``mask_sha256``): two versions of the code that fill the same masks print the same digest.

``--process`` also runs the same streams through the grammar process
(:class:`loom.structured.grammar_process.GrammarProcess`) in the engine's order with a step in
flight: take step k's rows (filled by the child meanwhile), queue the processor, note step k+1's
layout, send step k's tokens (the child accepts them and fills k+1's rows), then ``--other-us`` of
stand-in host work (the engine's output processing, scheduling and planning, during which the
child works). Its ``total`` is the engine thread's time in grammar calls, waits for the child
included, the figure to set beside the in-process ``total``. ``--processes 2`` runs them through a
group of two (:class:`loom.structured.grammar_group.GrammarProcessGroup`, requests alternating
between them); its ``child_step`` is the busier child's.

``--engine-step`` also times the engine's whole step without a grammar at 64 decode rows on a
tiny random model (a 1,024-token vocabulary, 2 layers of 64: the forward and the sampler are a
small part), the like-for-like denominator for a ratio. ``--profile N`` prints cProfile's top N
functions of the grammar loop.

    .venv/bin/python scripts/bench_grammar_host.py --compare --steps 300 --profile 25 --out x.json
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import hashlib
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

# One valid instance of each S1 schema: properties in the schema's order, as xgrammar lays JSON
# out (one line, ", " and ": " separators: json.dumps's defaults).
DOCUMENTS: dict[str, Any] = {
    "optional10": {"make": "Toyota", "model": "Corolla", "color": "red", "fuel": "petrol", "owner": "Ada"},
    "nested_arrays": {"matrix": [[1, 2, 3], [4, 5]], "labels": ["small", "digits"]},
    "enums": {"sentiment": "positive", "language": "fr", "confidence": "high"},
    "person": {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com"},
    "address": {"street": "11 Rue de Rivoli", "city": "Paris", "zip": "75001", "geo": {"lat": 48.86, "lon": 2.34}},
    "event": {"title": "Summer Jazz Night", "date": "2026-07-14", "attendees": 250, "online": False},
    "product": {"sku": "ABC-1234", "price": 19.99, "tags": ["red", "cotton"], "stock": 12},
    "recipe": {"dish": "Tomato soup", "steps": [{"order": 1, "text": "Chop the tomatoes"},
                                                {"order": 2, "text": "Simmer for twenty minutes"}],
               "vegetarian": True},
}


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def _summary_us(seconds: list[float]) -> dict[str, float]:
    return {"median_us": 1e6 * statistics.median(seconds), "p90_us": 1e6 * _pct(seconds, 0.9),
            "mean_us": 1e6 * statistics.fmean(seconds)}


def held_sequence(driver: Any, rid: str, spec: Any) -> Any:
    """A running sequence of a new request constrained by ``spec``, held by ``driver`` (either
    driver) until its grammar is ready."""
    from loom.engine.sequence import Sequence, SequenceStatus
    from loom.engine.types import EngineRequest, SamplingParams, StoppingParams

    req = EngineRequest(rid, (1, 504, 3458, 28, 253), SamplingParams(constraint=spec),
                        StoppingParams(max_new_tokens=512))
    seq = Sequence(req, 0, None)
    seq.status = SequenceStatus.RUNNING
    driver.hold(rid, spec, [seq])
    while True:
        ready, refused = driver.take_ready()
        assert not refused, refused
        if ready:
            return seq
        time.sleep(0.001)


class GrammarLoop:
    """64 constrained sequences following their documents through the driver's step calls."""

    def __init__(self, rows: int, fast: bool, duplicates: bool) -> None:
        from loom.bench.structured import SCHEMAS
        from loom.frontend.tokenizer import Tokenizer
        from loom.model_loader import eos_token_ids, load_hf_config, model_dims, resolve_model_dir
        from loom.structured.compiler_pool import GrammarCompilerPool
        from loom.structured.driver import StructuredOutput
        from loom.structured.spec import GrammarSpec
        from loom.structured.vocabulary import vocabulary_from_model_dir
        from loom.worker.staging import Stager

        model_dir = Path(resolve_model_dir(None))
        self.vocab = model_dims(load_hf_config(model_dir)).vocab_size
        self.eos = eos_token_ids(model_dir)
        tok = Tokenizer.from_model_dir(model_dir)
        self.names = list(SCHEMAS)
        self.specs = {n: GrammarSpec("json_schema", json.dumps(SCHEMAS[n]), "parameters.constraint.json_schema")
                      for n in self.names}
        # [schema] -> token ids of its document, then EOS
        self.docs = {n: [*tok.encode(json.dumps(DOCUMENTS[n]), add_special_tokens=False), self.eos[0]]
                     for n in self.names}
        pool = GrammarCompilerPool(lambda: vocabulary_from_model_dir(model_dir, self.vocab, self.eos), workers=1)
        self.driver = StructuredOutput(pool, self.vocab, self.eos, compile_timeout_s=600.0, fast_rows=fast)
        self.stager = Stager(torch.device("cpu"))
        self.rows = rows
        self.next_id = 0
        self.seqs: list[Any] = []
        self.pos: list[int] = []  # [rows] next token of each sequence's document
        self.schema: list[str] = []
        for i in range(rows):
            name = self.names[i % len(self.names)]
            seq = self._new_sequence(name)
            # staggered: row i starts i * 7 tokens into its document (accepted before timing); with
            # duplicates, as in S1 (8 identical greedy requests per schema), the rows of a schema
            # follow the same stream in step
            start = ((i % len(self.names) if duplicates else i) * 7) % (len(self.docs[name]) - 1)
            for t in self.docs[name][:start]:
                self._push(seq, t)
            assert not self.driver.accept_step([(seq, self.docs[name][:start])]) if start else True
            self.seqs.append(seq)
            self.pos.append(start)
            self.schema.append(name)
        self.digest = hashlib.sha256()
        self.replaced = 0

    def _new_sequence(self, name: str) -> Any:
        self.next_id += 1
        return held_sequence(self.driver, f"r{self.next_id - 1}", self.specs[name])

    @staticmethod
    def _push(seq: Any, token: int) -> None:
        seq.token_ids.append(token)

    def step(self, timings: dict[str, list[float]] | None) -> None:
        """One engine step's grammar calls: accept the previous step's tokens (done at the end of
        the previous call here), then this step's rows, the processor, and the tokens accepted."""
        from loom.engine.sequence import PENDING_TOKEN
        from loom.sample.batch import token_bitmask

        driver, seqs = self.driver, self.seqs
        for seq in seqs:  # the engine's commit: a placeholder for the token this step samples
            seq.token_ids.append(PENDING_TOKEN)
            seq.num_pending_tokens += 1
        tokens = [self.docs[n][p] for n, p in zip(self.schema, self.pos, strict=True)]
        t0 = time.perf_counter()
        matched = driver.any_matched(seqs)
        rows = driver.bitmask_rows(seqs)
        t1 = time.perf_counter()
        # the worker's call (its step's N rows; the plain path's code had no num_rows)
        processor = token_bitmask(rows, self.stager, len(seqs) if self.driver.fast_rows else None) \
            if rows is not None else None
        t2 = time.perf_counter()
        # the output processor: the placeholders are replaced by the tokens, then accepted
        refusals = driver.accept_step([(s, [t]) for s, t in zip(seqs, tokens, strict=True)
                                       if not s.is_finished]) if driver.any_matched(seqs) else {}
        ended = [s for s, t in zip(seqs, tokens, strict=True) if t in self.eos and driver.terminated(s)]
        t3 = time.perf_counter()
        assert matched and rows is not None and processor is not None and not refusals, refusals
        if timings is not None:
            timings["total"].append(t3 - t0)
            timings["rows"].append(t1 - t0)
            timings["processor"].append(t2 - t1)
            timings["accept"].append(t3 - t2)
        self._check(rows, tokens)
        self._advance(tokens, {s.seq_id for s in ended})

    def _check(self, rows: Any, tokens: list[int]) -> None:
        mask = rows.tensor()  # [G, W] int32
        for g, t in enumerate(tokens):
            assert (int(mask[g, t // 32]) >> (t % 32)) & 1, f"row {g} forbids its document's token {t}"
        self.digest.update(rows.to_bytes())
        self.digest.update(json.dumps(rows.rows).encode())

    def _advance(self, tokens: list[int], ended: set[int]) -> None:
        from loom.engine.sequence import SequenceStatus

        for i, (seq, t) in enumerate(zip(self.seqs, tokens, strict=True)):
            seq.token_ids[-1] = t
            seq.num_pending_tokens -= 1
            self.pos[i] += 1
            if seq.seq_id in ended:
                assert self.pos[i] == len(self.docs[self.schema[i]])
                seq.status = SequenceStatus.FINISHED
                self.seqs[i] = self._new_sequence(self.schema[i])
                self.pos[i] = 0
                self.replaced += 1


def bench_grammar(steps: int, rows: int, warmup: int, profile_top: int, compare: bool,
                  duplicates: bool) -> dict[str, Any]:
    """The fast path (and with ``compare`` the plain one, LOOM_GRAMMAR_FAST_ROWS=0, a step of
    each in turn over the same streams, so both see the same load) timed per step."""
    loops = {"fast": GrammarLoop(rows, True, duplicates)}
    if compare:
        loops["plain"] = GrammarLoop(rows, False, duplicates)
    for _ in range(warmup):
        for loop in loops.values():
            loop.step(None)
    timings: dict[str, dict[str, list[float]]] = {
        name: {"total": [], "rows": [], "processor": [], "accept": []} for name in loops}
    for _ in range(steps):
        for name, loop in loops.items():
            loop.step(timings[name])
    out: dict[str, Any] = {"num_rows": rows, "steps": steps, "duplicates": duplicates}
    for name, loop in loops.items():
        out[name] = {"requests_replaced": loop.replaced, "mask_sha256": loop.digest.hexdigest(),
                     **{k: _summary_us(v) for k, v in timings[name].items()}}
    if compare:
        out["identical_masks"] = out["fast"]["mask_sha256"] == out["plain"]["mask_sha256"]
        out["plain_over_fast_median"] = out["plain"]["total"]["median_us"] / out["fast"]["total"]["median_us"]
    for name, loop in loops.items() if profile_top else ():
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            loop.step(None)
        prof.disable()
        print(f"-- cProfile of {steps} steps, {name} path (the loop's checks and bookkeeping included) --")
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(profile_top)
    return out


class ProcessLoop:
    """The streams of :class:`GrammarLoop` through the grammar process, one step in flight. A
    sequence that ends at step k still has a (left open, unchecked) row in step k+1, whose layout
    was set before k's tokens were accepted; its replacement joins at step k+2."""

    def __init__(self, rows: int, duplicates: bool, processes: int = 1, spin_us: int = 0) -> None:
        from loom.model_loader import resolve_model_dir
        from loom.structured.grammar_group import GrammarProcessGroup
        from loom.structured.grammar_process import GrammarProcess, ProcessConfig
        from loom.worker.staging import Stager

        ref = GrammarLoop.__new__(GrammarLoop)  # the documents and specs only
        GrammarLoop.__init__(ref, 0, True, duplicates)
        self.ref = ref
        config = ProcessConfig(str(resolve_model_dir(None)), ref.vocab, tuple(ref.eos), 600.0, 256 << 20, workers=1,
                               spin_us=spin_us)
        self.driver: GrammarProcess | GrammarProcessGroup = (
            GrammarProcess(config) if processes == 1 else GrammarProcessGroup(config, processes))
        self.stager = Stager(torch.device("cpu"))
        self.next_id = 0
        self.seqs: list[Any] = []
        self.pos: list[int] = []
        self.schema: list[str] = []
        for i in range(rows):
            name = ref.names[i % len(ref.names)]
            seq = self._new_sequence(name)
            start = ((i % len(ref.names) if duplicates else i) * 7) % (len(ref.docs[name]) - 1)
            if start:
                assert not self.driver.accept_step([(seq, ref.docs[name][:start])])
            self.seqs.append(seq)
            self.pos.append(start)
            self.schema.append(name)
        self.digest = hashlib.sha256()
        self.replaced = 0
        self.launched: tuple[list[Any], list[int]] | None = None  # step k: its sequences, their tokens
        self.waiting: dict[int, str] = {}  # slot -> the schema of its replacement, joining next step

    def _new_sequence(self, name: str) -> Any:
        self.next_id += 1
        return held_sequence(self.driver, f"p{self.next_id - 1}", self.ref.specs[name])

    def step(self, timings: dict[str, list[float]] | None, other_s: float) -> None:
        from loom.engine.sequence import SequenceStatus
        from loom.sample.batch import token_bitmask

        driver, docs = self.driver, self.ref.docs
        for i, name in list(self.waiting.items()):  # replacements join at the launch after their predecessor's
            self.seqs[i], self.pos[i] = self._new_sequence(name), 0
            del self.waiting[i]
            self.replaced += 1
        seqs = list(self.seqs)
        tokens = [docs[n][p] for n, p in zip(self.schema, self.pos, strict=True)]
        t0 = time.perf_counter()
        prev = self.launched
        rows = processor = None
        if prev is not None:  # the launch: step k-1's rows, taken for its sampling
            rows = driver.bitmask_rows(prev[0])
            processor = token_bitmask(rows, self.stager, len(prev[0])) if rows is not None else None
        t1 = time.perf_counter()
        driver.will_sample(seqs)  # step k's forward is queued
        t2 = time.perf_counter()
        ended: set[int] = set()
        if prev is not None:  # step k-1 completes: its tokens to the child with step k's layout
            pseqs, ptokens = prev
            live = [(s, [t]) for s, t in zip(pseqs, ptokens, strict=True) if not s.is_finished]
            refusals = driver.accept_step(live)
            ended = {s.seq_id for s, t in zip(pseqs, ptokens, strict=True)
                     if not s.is_finished and t in self.ref.eos and driver.terminated(s)}
            assert not refusals, refusals
        t3 = time.perf_counter()
        if timings is not None:
            timings["total"].append(t3 - t0)
            timings["rows"].append(t1 - t0)
            timings["will_sample"].append(t2 - t1)
            timings["accept"].append(t3 - t2)
        if prev is not None:
            assert rows is not None and processor is not None
            self._check(rows, prev)
            for seq in prev[0]:
                if seq.seq_id in ended:
                    seq.status = SequenceStatus.FINISHED
        for i, seq in enumerate(self.seqs):  # step k's tokens, as the device would sample them
            if seq.is_finished:
                continue
            self.pos[i] += 1
            if self.pos[i] == len(docs[self.schema[i]]):
                seq.status = SequenceStatus.FINISHED  # (its EOS is step k's token: known at k's completion)
                self.waiting[i] = self.schema[i]
        self.launched = (seqs, tokens)
        end = time.perf_counter() + other_s  # the engine's other host work, the child's time to fill
        while time.perf_counter() < end:
            pass

    def _check(self, rows: Any, prev: tuple[list[Any], list[int]]) -> None:
        mask = rows.tensor()
        for g, (seq, t) in enumerate(zip(*prev, strict=True)):
            if g not in rows.rows:  # (forgotten: it ended)
                assert seq.is_finished
                continue
            assert (int(mask[rows.rows.index(g), t // 32]) >> (t % 32)) & 1, f"row {g} forbids its token {t}"


def bench_process(steps: int, rows: int, warmup: int, duplicates: bool, other_us: float,
                  processes: int = 1, spin_us: int = 0) -> dict[str, Any]:
    loop = ProcessLoop(rows, duplicates, processes, spin_us)
    try:
        for _ in range(warmup):
            loop.step(None, other_us / 1e6)
        timings: dict[str, list[float]] = {"total": [], "rows": [], "will_sample": [], "accept": []}
        before, waits_before = loop.driver.child_stats(), dataclasses.replace(loop.driver.waits)
        for _ in range(steps):
            loop.step(timings, other_us / 1e6)
        after, waits = loop.driver.child_stats(), loop.driver.waits
    finally:
        loop.driver.close()
    child: dict[str, float] = {}
    if before is not None and after is not None and after.steps > before.steps:
        n = after.steps - before.steps
        child = {"steps": n, "mean_us": (after.step_s - before.step_s) / n * 1e6,
                 "full_collections": after.collections - before.collections}
    fills = waits.fills - waits_before.fills
    engine_waits = {"fills": fills, "waited": waits.waits - waits_before.waits,
                    "mean_wait_us": (waits.wait_s - waits_before.wait_s) / max(1, fills) * 1e6}
    return {"num_rows": rows, "steps": steps, "duplicates": duplicates, "other_us": other_us, "processes": processes,
            "spin_us": spin_us,
            "requests_replaced": loop.replaced, "child_step": child, "engine_waits": engine_waits,
            **{k: _summary_us(v) for k, v in timings.items()}}


def bench_engine_step(rows: int, steps: int) -> dict[str, Any]:
    """The engine's step at ``rows`` decode rows without a grammar (tiny random model, CPU)."""
    from loom.config import EngineConfig
    from loom.engine.llm_engine import LLMEngine
    from loom.engine.types import EngineRequest, SamplingParams, StoppingParams

    engine = LLMEngine(EngineConfig(model_id="random:tiny-llama", max_batch_total_tokens=8192, warmup=False))
    for i in range(rows):
        engine.add_request(EngineRequest(f"u{i}", tuple(range(3, 3 + 8 + i % 5)), SamplingParams(),
                                         StoppingParams(max_new_tokens=steps + 40, ignore_eos=True)))
    for _ in range(20):  # the prefills, then decodes
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return {"rows": rows, "steps": steps, "model": "random:tiny-llama", **_summary_us(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="print cProfile's top N functions")
    ap.add_argument("--engine-step", action="store_true", help="also time the engine's step without a grammar")
    ap.add_argument("--compare", action="store_true", help="also run the plain path, a step of each in turn")
    ap.add_argument("--duplicates", action="store_true",
                    help="S1's layout: the 8 rows of a schema follow one stream (identical greedy requests)")
    ap.add_argument("--process", action="store_true", help="also the grammar process, one step in flight")
    ap.add_argument("--other-us", type=float, default=600.0,
                    help="--process: the engine's other host work a step, in microseconds (busy-waited)")
    ap.add_argument("--processes", type=int, default=1, help="--process: this many grammar processes (a group)")
    ap.add_argument("--spin-us", default=None,
                    help="--process: how long each side polls before it blocks (LOOM_GRAMMAR_SPIN_US; default: "
                         "the host's default). A list (0,2000) runs the process loop once per value, in turn, "
                         "--rounds times: the results are a list under process_by_spin")
    ap.add_argument("--rounds", type=int, default=1, help="--spin-us with several values: rounds of them")
    ap.add_argument("--process-only", action="store_true", help="skip the in-process loop")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from loom import kernel_switches

    spins = [int(v) for v in args.spin_us.split(",")] if args.spin_us else [kernel_switches.grammar_spin_us]
    result: dict[str, Any] = {} if args.process_only else {
        "grammar": bench_grammar(args.steps, args.rows, args.warmup, args.profile, args.compare, args.duplicates)}
    if args.process and len(spins) == 1:
        result["process"] = bench_process(args.steps, args.rows, args.warmup, args.duplicates, args.other_us,
                                          args.processes, spins[0])
    elif args.process:
        result["process_by_spin"] = [
            {"spin_us": spin, **bench_process(args.steps, args.rows, args.warmup, args.duplicates, args.other_us,
                                              args.processes, spin)}
            for _ in range(args.rounds) for spin in spins]
    if args.engine_step:
        result["engine_step_without_grammar"] = bench_engine_step(args.rows, args.steps)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
