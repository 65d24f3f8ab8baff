"""Grammar compilation on worker threads, off the engine's step loop, with a bounded cache.

xgrammar compiles in C++ and releases the interpreter lock while it does, so a worker thread in
the engine process compiles while the step loop keeps decoding (measured: a 0.8 s compile left
another thread's longest pause at 6 ms). A compiled grammar cannot cross a process boundary
cheaply (its serialized form was 175 KB for a 10-property schema, and deserializing it took as
long as a fifth of compiling), so compiling next to the matchers that use it is the cheap place.

The cache holds one future per ``(kind, text)``: a request whose grammar is being compiled for
another waits for the same compile (a hit). Finished entries are evicted least recently used
first once their compiled size passes ``cache_bytes``. Failures stay cached: the same bad text
fails again at once.

The vocabulary description (:mod:`.vocabulary`) is built once, by the first worker, before any
compile; until then no compile's time limit runs. A compile cannot be interrupted: one that runs
past its time limit keeps its thread until it ends, and the driver refuses the same text at once
meanwhile (:meth:`GrammarCompilerPool.timed_out`).
"""

from __future__ import annotations

import bisect
import contextlib
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from .grammars import GrammarError, clean_error, to_grammar
from .spec import GrammarSpec
from .vocabulary import VocabularyError

if TYPE_CHECKING:
    import xgrammar

log = structlog.get_logger(__name__)

# Seconds: upper bounds of the compile-time histogram's buckets (Prometheus "le").
COMPILE_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class CompileStats:
    """Running totals since the engine started (reported through EngineStats)."""

    queries: int = 0  # compile requests
    hits: int = 0  # of which answered by the cache (done, or being compiled for another request)
    compiles: int = 0  # compiles finished, successful or not
    failures: int = 0  # of which the text was invalid
    timeouts: int = 0  # requests refused because their compile ran past the time limit
    seconds_sum: float = 0.0  # time spent compiling
    # compiles per bucket of COMPILE_TIME_BUCKETS (not cumulative), the last one past the largest
    buckets: list[int] = field(default_factory=lambda: [0] * (len(COMPILE_TIME_BUCKETS) + 1))

    def observe(self, seconds: float) -> None:
        self.compiles += 1
        self.seconds_sum += seconds
        self.buckets[bisect.bisect_left(COMPILE_TIME_BUCKETS, seconds)] += 1


@dataclass
class _Entry:
    future: Future[xgrammar.CompiledGrammar]
    size: int = 0  # compiled bytes, once done
    finished: bool = False  # its compile ended (its future is resolved right after)


class GrammarCompilerPool:
    """Compiles :class:`GrammarSpec` s on ``workers`` daemon threads (daemons, so that a compile
    still running never holds up the engine process's exit)."""

    def __init__(self, vocabulary: Callable[[], xgrammar.TokenizerInfo], workers: int = 2,
                 cache_bytes: int = 256 << 20, compiler_threads: int = 1) -> None:
        self._vocabulary = vocabulary
        self._compiler_threads = compiler_threads
        self.cache_bytes = cache_bytes
        self.stats = CompileStats()
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._cached_bytes = 0
        self._timed_out: set[tuple[str, str]] = set()
        self._jobs: queue.SimpleQueue[tuple[GrammarSpec, Future[xgrammar.CompiledGrammar]]] = queue.SimpleQueue()
        self._ready = threading.Event()  # the vocabulary is described (or failed to be)
        self.ready_at: float | None = None  # time.monotonic() when it was
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._setup_error: str | None = None
        self._setup_lock = threading.Lock()
        self._threads = [threading.Thread(target=self._work, name=f"grammar-compile-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    # -- the engine's side --------------------------------------------------------------------
    def compile(self, spec: GrammarSpec) -> Future[xgrammar.CompiledGrammar]:
        """The compiled grammar of ``spec``, now or later. Fails with :class:`GrammarError` for a
        text that does not compile, :class:`VocabularyError` when no grammar can be compiled."""
        with self._lock:
            self.stats.queries += 1
            entry = self._cache.get(spec.key)
            if entry is not None:
                self._cache.move_to_end(spec.key)
                self.stats.hits += 1
                return entry.future
            future: Future[xgrammar.CompiledGrammar] = Future()
            self._cache[spec.key] = _Entry(future)
        self._jobs.put((spec, future))
        return future

    def timed_out(self, spec: GrammarSpec) -> bool:
        """Whether a compile of ``spec`` ran past a request's time limit and is still running."""
        with self._lock:
            entry = self._cache.get(spec.key)
            return spec.key in self._timed_out and entry is not None and not entry.future.done()

    def mark_timed_out(self, spec: GrammarSpec) -> None:
        with self._lock:
            self._timed_out.add(spec.key)
            self.stats.timeouts += 1

    def snapshot(self) -> CompileStats:
        with self._lock:
            s = self.stats
            return CompileStats(s.queries, s.hits, s.compiles, s.failures, s.timeouts, s.seconds_sum, list(s.buckets))

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    def __len__(self) -> int:
        return len(self._cache)

    # -- the workers --------------------------------------------------------------------------
    def _setup(self) -> None:
        """Describe the vocabulary and make the compiler, once (the first worker does it)."""
        with self._setup_lock:
            if self._ready.is_set():
                return
            started = time.monotonic()
            try:
                import xgrammar as xg

                info = self._vocabulary()
                self._compiler = xg.GrammarCompiler(info, max_threads=self._compiler_threads, cache_enabled=False)
                log.info("grammar compiler ready", vocab_size=info.vocab_size, vocab_type=info.vocab_type.name,
                         duration_s=round(time.monotonic() - started, 2))
            except VocabularyError as exc:
                self._setup_error = str(exc)
            except Exception as exc:  # an xgrammar that fails to import or load
                self._setup_error = f"the grammar engine failed to start: {type(exc).__name__}: {exc}"
            if self._setup_error is not None:
                log.error("structured output unavailable", reason=self._setup_error)
            self.ready_at = time.monotonic()
            self._ready.set()

    def _work(self) -> None:
        _lower_this_threads_priority()
        while True:
            spec, future = self._jobs.get()
            self._setup()
            if not future.set_running_or_notify_cancel():
                continue
            if self._compiler is None:
                future.set_exception(VocabularyError(self._setup_error or "no grammar compiler"))
                continue
            started = time.perf_counter()
            try:
                compiled = self._compile(self._compiler, spec)
            except GrammarError as exc:
                self._finished(spec, time.perf_counter() - started, failed=True)
                future.set_exception(exc)
            except Exception as exc:  # xgrammar's own failures while compiling a parsed grammar
                self._finished(spec, time.perf_counter() - started, failed=True)
                future.set_exception(GrammarError(clean_error(exc)))
            else:
                self._finished(spec, time.perf_counter() - started, size=compiled.memory_size_bytes)
                future.set_result(compiled)

    def _compile(self, compiler: xgrammar.GrammarCompiler, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        """One compile, on a worker thread (the interpreter lock is released inside xgrammar)."""
        return compiler.compile_grammar(to_grammar(spec))

    def _finished(self, spec: GrammarSpec, seconds: float, size: int = 0, failed: bool = False) -> None:
        with self._lock:
            self.stats.observe(seconds)
            if failed:
                self.stats.failures += 1
            self._timed_out.discard(spec.key)
            entry = self._cache.get(spec.key)
            if entry is not None:
                entry.size = size
                entry.finished = True
                self._cached_bytes += size
            self._evict()

    def _evict(self) -> None:
        """Drop finished entries, least recently used first, while the cache is over its size."""
        for key in list(self._cache):
            if self._cached_bytes <= self.cache_bytes:
                return
            entry = self._cache[key]
            if entry.finished:
                del self._cache[key]
                self._cached_bytes -= entry.size


COMPILE_NICENESS = 10  # added to a compile thread's niceness: it yields its core to the engine's threads


def _lower_this_threads_priority() -> None:
    """Give this (compile) thread a lower CPU priority than the engine's: a compile takes a core for
    seconds, and on a small machine the engine's step, whose torch operators run on every core,
    waits for it. On this project's 2-core VM (tests/e2e/test_structured_output.py's slow regex,
    two streams decoding beside it) the longest step was 0.63-0.94 s while the regex compiled in
    ~2 s, and 0.37-0.59 s with the compile niced, which then took 3.9-5.9 s: the running streams
    go first, as structured output promises. Linux keeps a niceness per thread; elsewhere, or
    where it is refused, nothing changes."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)
