"""The engine's worker when the model is split over ``--num-shard N`` tensor-parallel ranks.

Rank 0 is an ordinary :class:`Worker` in the engine process; ranks 1..N-1 are processes of
their own (``loom.worker.rank_process``), started here. :class:`ShardedWorker` has the calls of
a :class:`Worker` (the engine core cannot tell them apart): each one is sent to the other ranks
as one command (``rank_commands``: pickled once, written once into a ring in shared memory that
every rank reads, ``loom.distributed.command_ring``; one gloo ``broadcast_object_list`` where the
ring is not supported; never N copies over pipes) and then carried out by rank 0's own worker. Every rank samples
the same tokens (the gathered logits are the same bytes on every rank, and the noise is a hash
of seed, position and token), so no token travels back: rank 0's :class:`StepOutput` is the
step's, and each rank keeps its own sampled ids on its device for the next step's pending rows.

Failures end the engine rather than hang it. A watchdog thread looks twice a second at the rank
processes and at the shared step counters (``loom.distributed.progress``): a rank that exited,
or that has not finished a command after ``--shard-step-timeout`` seconds
(``--shard-start-timeout`` while loading and warming up), is reported by ``on_failure`` with a
message naming it; the default stops every rank and exits the process. A collective that fails
in the step itself (a peer's socket closed) raises :class:`ShardLostError`, which the engine does
not treat as one request's fault.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import structlog
import torch

from loom.config import ConfigError, EngineConfig
from loom.distributed.command_ring import CommandRing, RingAborted
from loom.distributed.command_ring import supported as command_ring_supported
from loom.distributed.errors import ShardLostError
from loom.distributed.launch import RANK_ENV, destroy, free_loopback_port, init_rank, rank_device
from loom.distributed.progress import StepProgress
from loom.plugin_api import PluginRegistry
from loom.sample.batch import TokenBitmaskRows

from .kernel_warmup import WarmUpCounts
from .model_runner import ForwardedStep, LaunchedStep, ModelRunner
from .rank_commands import (
    CaptureGraphs,
    Envelope,
    Execute,
    ExecuteForward,
    FreeKvCache,
    InitKvCache,
    ProfileEnd,
    ProfileStart,
    RankCommand,
    Sample,
    Stop,
)
from .rank_process import RankSpec, broadcast_command
from .step_plan import StepOutput, StepPlan
from .worker import LoadedModelInfo, Worker

log = structlog.get_logger(__name__)

_WATCH_INTERVAL_S = 0.5
_STOP_TIMEOUT_S = 10.0
_REPORT_WAIT_S = 5.0  # how long a step that met a lost rank waits for the watchdog to report it


def _default_on_failure(reason: str) -> None:
    log.critical("tensor-parallel rank lost; the engine exits", reason=reason)
    os._exit(1)


class ShardedWorker:
    """Rank 0's worker, plus the other ranks' processes behind one broadcast per call."""

    def __init__(self, config: EngineConfig, registry: PluginRegistry, *,
                 on_failure: Callable[[str], None] | None = None, log_json: bool = False,
                 log_level: str = "INFO") -> None:
        from loom.distributed.shard_check import check_shardable
        from loom.model_loader import load_hf_config, resolve_model_dir

        n = config.num_shard
        if config.device.startswith("cuda:"):
            raise ConfigError(f"--device {config.device} names one GPU; --num-shard {n} takes one GPU per rank "
                              "(choose them with CUDA_VISIBLE_DEVICES and --device cuda)")
        device = rank_device(config.device, 0)
        if device.startswith("cuda") and torch.cuda.device_count() < n:
            raise ConfigError(f"--num-shard {n} needs {n} GPUs, {torch.cuda.device_count()} are visible "
                              f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
        model_dir = resolve_model_dir(config.model_id)  # converts a .gguf once, before the ranks read it
        check_shardable(load_hf_config(model_dir), n)
        self.world_size = n
        self._on_failure = on_failure or _default_on_failure
        self._lock = threading.Lock()
        self._closing = False
        self._failed: str | None = None
        self._reported = threading.Event()  # set once on_failure has been told what _failed says
        self._serving = False
        self._seq = 0
        self._issued_at: deque[tuple[int, float]] = deque()
        self._local_busy_since: float | None = None
        self._timeouts = (config.shard_start_timeout, config.shard_step_timeout)
        self.progress = StepProgress.create(n)
        # Commands travel through shared memory where the memory order allows (x86-64), else gloo
        # (also with one rank, which has no reader to write for).
        self.ring: CommandRing | None = CommandRing.create(n) if n > 1 and command_ring_supported() else None
        port = free_loopback_port()
        rank_config = replace(config, model_id=str(model_dir))
        self.procs: list[subprocess.Popen[bytes]] = []
        env = {**os.environ, **RANK_ENV}
        for rank in range(1, n):
            spec = RankSpec(replace(rank_config, device=rank_device(config.device, rank)), rank, n, port,
                            rank_device(config.device, rank), str(self.progress.path), os.getpid(), log_json,
                            log_level, str(self.ring.path) if self.ring is not None else None)
            proc = subprocess.Popen([sys.executable, "-m", "loom.worker.rank_process"], stdin=subprocess.PIPE,
                                    env=env, start_new_session=False)
            assert proc.stdin is not None
            proc.stdin.write(pickle.dumps(spec))
            proc.stdin.close()
            self.procs.append(proc)
        log.info("tensor-parallel ranks started", num_shard=n, port=port, device=device,
                 pids=[p.pid for p in self.procs])
        self._watchdog = threading.Thread(target=self._watch, name="shard-watchdog", daemon=True)
        self._watchdog.start()
        try:
            self.group = init_rank(0, n, port, device, config.shard_start_timeout)
            error: str | None = None
            local: Worker | None = None
            try:
                local = Worker(replace(rank_config, device=device), registry)
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                load_error: Exception = exc
            import torch.distributed as dist

            errors: list[Any] = [None] * n
            dist.all_gather_object(errors, error, group=self.group)
            if local is None:
                raise load_error
            bad = [(r, e) for r, e in enumerate(errors) if e]
            if bad:
                raise ConfigError("; ".join(f"tensor-parallel rank {r} could not load the model: {e}" for r, e in bad))
        except BaseException:
            self.close()
            raise
        self.local: Worker = local
        self.config = config

    # -- what the engine reads ------------------------------------------------------------------
    @property
    def info(self) -> LoadedModelInfo:
        return self.local.info

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def runner(self) -> ModelRunner | None:
        return self.local.runner

    @property
    def lora(self) -> None:
        """LoRA is not served with tensor parallelism yet (EngineConfig refuses the combination)."""
        return None

    @property
    def kv_bytes_per_token(self) -> int:
        """One token's K and V in one rank's pool (every rank's is the same size)."""
        return self.local.kv_bytes_per_token

    @property
    def max_graph_batch_size(self) -> int | None:
        return self.local.max_graph_batch_size

    def warm_up_token_counts(self, max_tokens: int, max_rows: int) -> WarmUpCounts:
        """Rank 0's counts: every rank holds slices of the same shapes, so the same counts
        compile every rank's variants (the warm-up's steps reach every rank as usual)."""
        return self.local.warm_up_token_counts(max_tokens, max_rows)

    def mark_serving(self) -> None:
        """Start-up is over: from now on a command gets ``--shard-step-timeout`` seconds."""
        self._serving = True

    # -- calls, broadcast to every rank -----------------------------------------------------------
    def _broadcast(self, command: RankCommand) -> int:
        if self._failed is not None:
            raise self._verdict()
        self._seq += 1
        self.progress.issue(self._seq)
        self._issued_at.append((self._seq, time.monotonic()))
        try:
            self._send(Envelope(self._seq, command))
        except RingAborted as exc:
            raise self._verdict() from exc
        except Exception as exc:
            raise (self._lost(exc, wait_s=2.0) or ShardLostError(f"broadcasting to the ranks failed: {exc}")) from exc
        return self._seq

    def _send(self, envelope: Envelope) -> None:
        """One command to every other rank: through the ring (a command too large for a slot
        follows over gloo), or one gloo broadcast."""
        if self.ring is None:
            broadcast_command(envelope, self.group)
        else:
            self.ring.send(envelope, lambda obj: broadcast_command(obj, self.group), lambda: self._failed)

    def _run_local(self, seq: int, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as exc:
            lost = self._lost(exc, wait_s=2.0)
            if lost is not None:
                raise lost from exc
            raise  # one request's fault: every rank raised it the same way
        finally:
            self.progress.mark_done(0, seq)

    def _verdict(self) -> ShardLostError:
        """The watchdog's verdict as the error the engine raises, once ``on_failure`` has heard it
        (the watchdog publishes ``_failed`` first so that steps stop at once, then reports: a
        caller that saw the error before the report could not find the failure reported)."""
        self._reported.wait(_REPORT_WAIT_S)
        return ShardLostError(self._failed or "a tensor-parallel rank was lost")

    def _lost(self, exc: Exception, wait_s: float = 0.0) -> ShardLostError | None:
        """A :class:`ShardLostError` if ``exc`` came from a lost rank (the watchdog's verdict, or
        a rank process found dead within ``wait_s``); None for an ordinary error."""
        deadline = time.monotonic() + wait_s
        while True:
            if self._failed is not None:
                return self._verdict()
            reason = self._dead_rank()
            if reason is not None:
                return ShardLostError(reason)
            if type(exc).__name__ == "DistBackendError" or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if type(exc).__name__ == "DistBackendError":
            return ShardLostError(f"a collective between the tensor-parallel ranks failed: {exc}")
        return None

    def init_kv_cache(self, num_blocks: int) -> None:
        seq = self._broadcast(InitKvCache(num_blocks))
        self._run_local(seq, lambda: self.local.init_kv_cache(num_blocks))

    def free_kv_cache(self) -> None:
        seq = self._broadcast(FreeKvCache())
        self._run_local(seq, self.local.free_kv_cache)

    def capture_cuda_graphs(self, max_model_len: int, query_lens: tuple[int, ...] = (1,)) -> None:
        seq = self._broadcast(CaptureGraphs(max_model_len, query_lens))
        self._run_local(seq, lambda: self.local.capture_cuda_graphs(max_model_len, query_lens))

    def profile_gpu_memory(self, run: Callable[[], Any]) -> tuple[int, int, int]:
        """The warm-up's memory on every rank; the worst of each (largest activations and weights,
        smallest device): the pool is then sized for the tightest rank, and every rank allocates
        the same number of blocks."""
        import torch.distributed as dist

        seq = self._broadcast(ProfileStart())
        base = self._run_local(seq, self.local.profile_start)
        run()
        seq = self._broadcast(ProfileEnd())
        mine = self._run_local(seq, lambda: self.local.profile_end(base))
        replies: list[Any] = [None] * self.world_size
        dist.gather_object(mine, replies, dst=0, group=self.group)
        return (max(r[0] for r in replies), max(r[1] for r in replies), min(r[2] for r in replies))

    def execute(self, plan: StepPlan) -> LaunchedStep:
        seq = self._broadcast(Execute(plan))
        return self._run_local(seq, lambda: self.local.execute(plan))

    def execute_forward(self, plan: StepPlan) -> ForwardedStep:
        seq = self._broadcast(ExecuteForward(plan))
        return self._run_local(seq, lambda: self.local.execute_forward(plan))

    def sample(self, step: ForwardedStep, bitmask: TokenBitmaskRows | None) -> LaunchedStep:
        """Every rank samples, so the grammar rows go to every rank: a second command in a
        constrained step, sent while the ranks run its forward."""
        seq = self._broadcast(Sample(bitmask))
        return self._run_local(seq, lambda: self.local.sample(step, bitmask))

    def finish(self, step: LaunchedStep) -> StepOutput:
        self._local_busy_since = time.monotonic()
        try:
            return self.local.finish(step)
        finally:
            self._local_busy_since = None

    # -- failures ---------------------------------------------------------------------------------
    def _dead_rank(self) -> str | None:
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                return f"tensor-parallel rank {rank} (pid {proc.pid}) {how}"
        return None

    def _hung(self) -> str | None:
        timeout = self._timeouts[1] if self._serving else self._timeouts[0]
        flag = "--shard-step-timeout" if self._serving else "--shard-start-timeout"
        now = time.monotonic()
        if self._local_busy_since is not None and now - self._local_busy_since > timeout:
            return (f"tensor-parallel rank 0's step did not complete within {timeout:g} s (a device or a "
                    f"collective hangs; {flag})")
        # Only this thread pops; the step loop appends (issued commands, oldest first).
        finished = min(self.progress.done(r) for r in range(self.world_size))
        while self._issued_at and self._issued_at[0][0] <= finished:
            self._issued_at.popleft()
        if not self._issued_at:
            return None
        oldest, issued_at = self._issued_at[0]
        if now - issued_at <= timeout:
            return None
        behind = [r for r in range(self.world_size) if self.progress.done(r) < oldest]
        if not behind:
            return None
        peers = [r for r in behind if r != 0] or behind  # rank 0 waits on them in the collective
        names = ", ".join(str(r) for r in peers)
        return (f"tensor-parallel rank{'s' if len(peers) > 1 else ''} {names} did not finish command "
                f"#{oldest} within {timeout:g} s (hung; {flag})")

    def _watch(self) -> None:
        while not self._closing:
            time.sleep(_WATCH_INTERVAL_S)
            if self._closing or self._failed is not None:
                return
            reason = self._dead_rank() or self._hung()
            if reason is not None:
                self._failed = reason
                log.error("tensor-parallel rank lost", reason=reason)
                self._kill_ranks()
                try:
                    self._on_failure(reason)
                finally:
                    self._reported.set()
                return

    # -- stopping -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every rank: a ``Stop`` command when they are healthy, then SIGKILL for any that
        has not exited within 10 s. Idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        if self._failed is None and hasattr(self, "local") and all(p.poll() is None for p in self.procs):
            try:
                self._seq += 1
                self._send(Envelope(self._seq, Stop()))
            except Exception as exc:
                log.warning("could not send the ranks their stop", error=repr(exc))
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel rank did not stop; killing it", pid=proc.pid)
        self._kill_ranks()
        try:
            destroy()
        except Exception as exc:
            log.debug("process group teardown failed", error=repr(exc))
        self.progress.close(unlink=True)
        if self.ring is not None:
            self.ring.close(unlink=True)

    def _kill_ranks(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait()

