"""What the launch-plan sweeps (``bench_decode_plans.py``, ``bench_dense_gemv.py``) share: timing a
call replayed from a CUDA graph with the L2 cache cold, compiling the candidates' kernels in
parallel processes first, and the small statistics the choices use.

Cold L2: a decode step reads its weights and its K/V once; the next read of the same bytes comes
a whole step later, after gigabytes of other reads. A call replayed back to back would find its
few megabytes in the H200's 50 MB L2 and look faster than it runs, so each call in the graph
follows a read of twice the L2's size (a reduction over a buffer), and the time of a graph of
those reads alone is subtracted. The metadata (block tables, sequence lengths) is evicted too,
as it is between two layers of a real step.

Compiling: each Triton variant (tile, warps, stages, constexpr flags) compiles once, about a
second on the H200's host. The sweeps run a list of calls in worker processes (spawned,
each with its own CUDA context; :class:`Compiler`) so that the compiled kernels land in Triton's
on-disk cache, where the timing process then finds them.
"""

from __future__ import annotations

import math
import multiprocessing
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

import torch


class GraphTimer:
    """Seconds per call of ``fn``: ``reps`` calls captured in one CUDA graph, each after an L2
    flush when ``cold``, the best of ``rounds`` replays, less the flushes' own time. On a CPU
    (``--interpret`` checks of the scripts) one plain call's wall time."""

    def __init__(self, device: torch.device, cold: bool = True, reps: int = 10, rounds: int = 3) -> None:
        self.device, self.cold, self.reps, self.rounds = device, cold, reps, rounds
        self.flush_s = 0.0
        self._flush: Callable[[], None] | None = None
        if device.type == "cuda" and cold:
            l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20))
            buf = torch.ones(2 * l2 // 4, dtype=torch.float32, device=device)  # twice the L2, read
            out = torch.empty((), dtype=torch.float32, device=device)

            def flush() -> None:
                torch.sum(buf, dim=0, out=out)

            self._flush = flush
            self.flush_s = self._graphed(lambda: None, rounds=max(5, rounds))

    def _graphed(self, fn: Callable[[], Any], rounds: int) -> float:
        flush = self._flush

        def step() -> None:
            if flush is not None:
                flush()
            fn()

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
            step()  # compile and warm up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(self.reps):
                step()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best = float("inf")
        graph.replay()  # warm
        for _ in range(rounds):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1000 / self.reps)
        return best

    def __call__(self, fn: Callable[[], Any]) -> float:
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        return max(0.0, self._graphed(fn, self.rounds) - self.flush_s)


def graphed_us_per_call(step: Callable[[int], Any], calls: int, replays: int) -> float:
    """Device microseconds a call of ``step(i)``: ``step(0)`` and ``step(1)`` run on a side stream
    (compiles, warm-up), then ``step(0) .. step(calls - 1)`` captured in one CUDA graph, replayed
    once and then ``replays`` times between two events. No L2 flush: what ``step`` reads decides
    (the pair and tile benches cycle their calls through distinct weights where that matters)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(2):
            step(i)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            step(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays / calls


def copy_bandwidth(device: torch.device) -> float:
    """Bytes a second, read plus written, of a 1 GiB device-to-device copy (1e10 off CUDA)."""
    if device.type != "cuda":
        return 1e10
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    t = GraphTimer(device, cold=False, reps=5, rounds=3)(lambda: b.copy_(a))
    return 2 * a.numel() / t


class Compiler:
    """Spawned processes (each with its own CUDA context) that run calls launching each of a
    task's kernels once, so that they are compiled into Triton's on-disk cache ahead of the
    timing process. With ``jobs <= 1`` nothing runs: the timing process compiles as it goes."""

    def __init__(self, jobs: int) -> None:
        self.pool = (ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"))
                     if jobs > 1 else None)
        self.jobs = jobs

    def submit(self, worker: Callable[[Any], int], tasks: Sequence[Any]) -> list[Future[int]]:
        """``worker(task)`` for every task (``worker`` a module-level function), started now."""
        return [] if self.pool is None else [self.pool.submit(worker, t) for t in tasks]

    @staticmethod
    def wait(futures: Sequence[Future[int]]) -> tuple[int, int]:
        """(kernels compiled, tasks that failed) once every future is done."""
        done = failed = 0
        for f in futures:
            try:
                done += f.result()
            except Exception:  # a worker that could not start: the timing process compiles instead
                failed += 1
        return done, failed

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)


def geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(max(v, 1e-30)) for v in values) / len(values)) if values else float("nan")


class Budget:
    """A wall-clock budget: ``spent()`` once ``seconds`` have passed since it was made."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.t0 = seconds, time.monotonic()

    def spent(self) -> bool:
        return time.monotonic() - self.t0 > self.seconds

    def elapsed(self) -> float:
        return time.monotonic() - self.t0
