"""Prometheus metrics of one server, under the ``loom_`` prefix, in a registry of their own.

TGI's request, queue and batch families are kept under their TGI names (``tgi_`` -> ``loom_``),
plus what TGI users asked for and vLLM has: time to first token, inter-token latency, KV-cache
usage, prefix-cache hits and preemptions. docs/observability.md lists every family.

Three sources feed the registry:

- the front end records each generation request (:mod:`loom.server.telemetry`);
- :class:`~loom.server.rpc_metrics.RpcMetricsInterceptor` counts every RPC by method and code;
- :class:`EngineStatsCollector` turns the engine's last :class:`EngineStats` snapshot into
  gauges and counters when scraped. :class:`EngineStatsPoller` refreshes that snapshot every
  second and just before each scrape.

A registry per server (not prometheus_client's global one) lets several servers live in one
process (tests) and keeps the exposition free of the client library's process metrics, which
would describe the front-end process only, not the engine process that does the work.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol

import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from loom.engine.core_process import EngineDeadError
from loom.engine.types import EngineInfo, EngineStats
from loom.structured.compiler_pool import COMPILE_TIME_BUCKETS

log = structlog.get_logger(__name__)

# Seconds. Whole requests and RPCs run from milliseconds (a rejection) to minutes (a long stream).
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
# Seconds until the first token: vLLM's buckets, so dashboards written for it read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
# Seconds per token: one decode step, from sub-millisecond (GPU, small batch) to a slow CPU step.
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                         0.75, 1.0, 2.5, 5.0)
# Token counts: powers of two up to 128k.
TOKEN_COUNT_BUCKETS = tuple(float(2**i) for i in range(18))
VALIDATION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

# loom_request_failure's err label: why a generation request did not complete.
FAILURE_KINDS = ("validation", "overloaded", "unavailable", "shutdown", "generation", "cancelled", "deadline")
# loom_constrained_requests' kind label: the field of parameters.constraint that was set.
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


class Metrics:
    """Every family of one server. Request-level ones are recorded by :mod:`loom.server.telemetry`."""

    def __init__(self, admission_queued: Callable[[], int] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # -- requests (TGI's families) --------------------------------------------------------
        self.request_count = Counter(
            "loom_request_count", "Generation requests received (Generate and GenerateStream)", registry=r)
        self.request_success = Counter(
            "loom_request_success", "Generation requests answered in full", registry=r)
        self.request_failure = Counter(
            "loom_request_failure", "Generation requests that did not complete, by reason", ["err"], registry=r)
        for kind in FAILURE_KINDS:  # every reason from 0, so rate() and sums work before the first failure
            self.request_failure.labels(err=kind)
        self.request_duration = Histogram(
            "loom_request_duration", "Seconds from arrival to the end of a successful request",
            buckets=DURATION_BUCKETS, registry=r)
        self.request_validation_duration = Histogram(
            "loom_request_validation_duration", "Seconds spent validating and tokenizing a request",
            buckets=VALIDATION_BUCKETS, registry=r)
        self.request_queue_duration = Histogram(
            "loom_request_queue_duration",
            "Seconds from the end of validation until the engine first ran the request "
            "(admission wait queue plus the engine's waiting list)",
            buckets=DURATION_BUCKETS, registry=r)
        self.request_inference_duration = Histogram(
            "loom_request_inference_duration",
            "Seconds from the engine first running a successful request to its last token (prefill + decode)",
            buckets=DURATION_BUCKETS, registry=r)
        self.request_mean_time_per_token_duration = Histogram(
            "loom_request_mean_time_per_token_duration",
            "Mean seconds per generated token after the first, per successful request",
            buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.request_input_length = Histogram(
            "loom_request_input_length", "Prompt tokens of each validated request",
            buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self.request_max_new_tokens = Histogram(
            "loom_request_max_new_tokens", "max_new_tokens of each validated request",
            buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self.request_generated_tokens = Histogram(
            "loom_request_generated_tokens",
            "Tokens generated by each successful request, all its completions (best_of ones too) together",
            buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self.constrained_requests = Counter(
            "loom_constrained_requests",
            "Validated generation requests with a constraint (structured output), by the kind set",
            ["kind"], registry=r)
        for kind in CONSTRAINT_KINDS:
            self.constrained_requests.labels(kind=kind)
        self.adapter_requests = Counter(
            "loom_adapter_requests",
            "Validated generation requests for a LoRA adapter, by adapter_id (loaded adapters only: an "
            "unknown id is refused before it is counted)", ["adapter"], registry=r)
        # -- token latency (what TGI lacks) -----------------------------------------------------
        self.time_to_first_token = Histogram(
            "loom_time_to_first_token_seconds", "Seconds from a request's arrival to its first generated token",
            buckets=TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "loom_inter_token_latency_seconds",
            "Seconds between consecutive tokens of one completion, as the front end received them",
            buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        # -- speculative decoding (--speculate) -------------------------------------------------
        self.speculative_draft_tokens = Counter(
            "loom_speculative_draft_tokens", "Draft tokens the model verified", registry=r)
        self.speculative_accepted_tokens = Counter(
            "loom_speculative_accepted_tokens", "Draft tokens the model accepted", registry=r)
        self.speculative_tokens_per_step = Histogram(
            "loom_speculative_tokens_per_step",
            "Tokens one completion gained in one verifying step: the accepted drafts plus the model's own",
            buckets=(1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 17), registry=r)
        # -- per RPC (every method, health and reflection included) ---------------------------
        self.grpc_requests = Counter(
            "loom_grpc_requests", "RPCs finished, by full method name and status code", ["method", "code"], registry=r)
        self.grpc_request_duration = Histogram(
            "loom_grpc_request_duration_seconds",
            "Seconds from the start of an RPC to its end (for a stream: its last message or its failure)",
            ["method", "code"], buckets=DURATION_BUCKETS, registry=r)
        # -- the engine (from its stats snapshot) ---------------------------------------------
        self.engine = EngineStatsCollector(admission_queued)
        r.register(self.engine)


class EngineStatsCollector(Collector):
    """Gauges and counters read from the engine's last stats snapshot at scrape time.

    The counters are the engine's own running totals, reported as they are: they only grow for
    the life of the engine process, which is the life of the server (the server stops when the
    engine process is gone). Nothing is reported about the engine before its first snapshot.
    """

    def __init__(self, admission_queued: Callable[[], int] | None = None) -> None:
        self.stats: EngineStats | None = None
        self.info: EngineInfo | None = None
        self._admission_queued = admission_queued

    def describe(self) -> list[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        # Names for the registry's duplicate check; collect() may yield nothing before the first snapshot.
        return list(self._families(EngineStats(0, 0, 0, 0, 0, 0), 0, 0))

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        queued = self._admission_queued() if self._admission_queued is not None else 0
        max_total = self.info.max_batch_total_tokens if self.info is not None else None
        if self.stats is None:
            queue = GaugeMetricFamily("loom_queue_size", _QUEUE_HELP, labels=["queue"])
            queue.add_metric(["admission"], queued)
            yield queue
            if max_total is not None:
                yield GaugeMetricFamily("loom_batch_max_total_tokens", _MAX_TOTAL_HELP, value=max_total)
            return
        yield from self._families(self.stats, queued, max_total)

    @staticmethod
    def _families(s: EngineStats, queued: int,
                  max_total: int | None) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        queue = GaugeMetricFamily("loom_queue_size", _QUEUE_HELP, labels=["queue"])
        queue.add_metric(["admission"], queued)
        queue.add_metric(["engine"], s.num_waiting)
        yield queue
        yield GaugeMetricFamily("loom_batch_current_size", "Sequences the engine is running (decoding or prefilling)",
                                value=s.num_running)
        if max_total is not None:
            yield GaugeMetricFamily("loom_batch_max_total_tokens", _MAX_TOTAL_HELP, value=max_total)
        usage = 1.0 - s.num_free_blocks / s.num_blocks if s.num_blocks else 0.0
        yield GaugeMetricFamily("loom_kv_cache_usage_ratio",
                                "Share of KV-cache blocks in use (0..1); cached prefix blocks nobody uses count as free",
                                value=usage)
        yield GaugeMetricFamily("loom_kv_cache_free_blocks", "KV-cache blocks free", value=s.num_free_blocks)
        yield GaugeMetricFamily("loom_kv_cache_blocks", "KV-cache blocks in the pool", value=s.num_blocks)
        yield CounterMetricFamily("loom_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  value=s.prefix_cache_queries)
        yield CounterMetricFamily("loom_prefix_cache_hits", "Prompt tokens served from the prefix cache",
                                  value=s.prefix_cache_hits)
        yield CounterMetricFamily("loom_preemptions", "Sequences preempted (their KV freed, to be recomputed)",
                                  value=s.num_preemptions)
        yield CounterMetricFamily("loom_prefill_chunks", "Prompt pieces prefilled that did not finish their prompt (chunked prefill)",
                                  value=s.num_prefill_chunks)
        yield CounterMetricFamily("loom_engine_steps", "Engine steps (one forward pass each)", value=s.num_steps)
        yield from _grammar_families(s)


def _grammar_families(s: EngineStats) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
    """Structured output's compiles, from the engine's running totals."""
    yield CounterMetricFamily("loom_grammar_cache_queries", "Grammars asked of the compile cache (one per constrained request)",
                              value=s.grammar_cache_queries)
    yield CounterMetricFamily("loom_grammar_cache_hits",
                              "Grammars found in the compile cache (compiled, or being compiled for another request)",
                              value=s.grammar_cache_hits)
    yield CounterMetricFamily("loom_grammar_compile_timeouts",
                              "Constrained requests refused because their grammar ran past --grammar-compile-timeout",
                              value=s.grammar_compile_timeouts)
    counts = list(s.grammar_compile_buckets) or [0] * (len(COMPILE_TIME_BUCKETS) + 1)
    cumulative, total = [], 0
    for le, n in zip((*(f"{b:g}" for b in COMPILE_TIME_BUCKETS), "+Inf"), counts, strict=True):
        total += n
        cumulative.append((le, total))
    yield HistogramMetricFamily("loom_grammar_compile_seconds",
                                "Seconds each grammar took to compile, on the engine's compile workers (cache misses)",
                                buckets=cumulative, sum_value=s.grammar_compile_seconds)


_QUEUE_HELP = ("Waiting generation work: requests in the admission wait queue (queue=admission) and "
               "sequences in the engine's waiting list (queue=engine)")
_MAX_TOTAL_HELP = "KV-cache size in tokens (--max-batch-total-tokens, or what warm-up sized)"


class StatsSource(Protocol):
    async def stats(self) -> EngineStats: ...

    def is_alive(self) -> bool: ...


class EngineStatsPoller:
    """Keeps :class:`EngineStatsCollector`'s snapshot fresh: every ``interval`` s and before scrapes.

    The engine answers a stats query between two steps, so an answer can take a step's time.
    Concurrent refreshes share one query, and a caller that stops waiting (a scrape's timeout)
    never cancels it: a query is never abandoned in the engine client.
    """

    def __init__(self, collector: EngineStatsCollector, interval_s: float = 1.0) -> None:
        self.collector = collector
        self.interval_s = interval_s
        self._engine: StatsSource | None = None
        self._query: asyncio.Task[None] | None = None

    def attach(self, engine: StatsSource, info: EngineInfo | None = None) -> None:
        self._engine = engine
        self.collector.info = info

    async def refresh(self, timeout_s: float | None = None) -> None:
        """Ask the engine for a snapshot; wait for it at most ``timeout_s`` s (it is kept anyway)."""
        if self._engine is None or not self._engine.is_alive():
            return
        if self._query is None or self._query.done():
            self._query = asyncio.ensure_future(self._fetch(self._engine))
        await asyncio.wait({self._query}, timeout=timeout_s)

    async def _fetch(self, engine: StatsSource) -> None:
        try:
            self.collector.stats = await engine.stats()
        except EngineDeadError:
            self._engine = None  # the server's watchdog stops the server
        except Exception as exc:
            log.warning("engine stats query failed", error=repr(exc))

    async def run(self) -> None:
        """Refresh every interval until cancelled or the engine is gone."""
        while self._engine is not None:
            await self.refresh()
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        if self._query is not None and not self._query.done():
            self._query.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._query
