"""A tensor-parallel rank other than 0: its own process, its own worker, the engine's commands.

The engine process starts it (``python -m loom.worker.rank_process``, its :class:`RankSpec`
pickled on stdin), so that the rank does not depend on how the engine process itself was
started (a daemonic multiprocessing child may not have children of its own). The rank:

1. dies with the engine (``PR_SET_PDEATHSIG``: SIGKILL when its parent exits, whatever the way),
   and ignores SIGINT / SIGTERM as the engine does: supervisors signal the whole process group,
   and the engine decides when the ranks stop (``Stop``, after the front end drained);
2. joins the process group (``loom.distributed.launch``), builds its worker (the model's slices
   of this rank, its KV heads) and tells every rank whether that worked (one ``all_gather``);
3. carries out the engine's commands (``rank_commands``) as they arrive (through the shared-memory
   command ring, ``loom.distributed.command_ring``, or a gloo broadcast), marking each one
   finished in the shared step counters the engine's watchdog reads.

A step that raises here raises on rank 0 too (same plan, same code): the engine isolates the
faulty request and sends the re-runs, which this rank simply follows.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from loom.config import EngineConfig

log = structlog.get_logger(__name__)

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RankSpec:
    config: EngineConfig  # the engine's, model_id resolved to the model's directory
    rank: int
    world_size: int
    port: int
    device: str  # "cpu" or "cuda:RANK"
    progress_path: str
    parent_pid: int
    log_json: bool = False
    log_level: str = "INFO"
    ring_path: str | None = None  # the command ring's file (loom.distributed.command_ring); None: gloo


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent exits (Linux); exit now if the parent is gone already."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def broadcast_command(obj: Any, group: Any) -> Any:
    """Rank 0: send ``obj``; others: receive it (one pickling, one broadcast over the gloo group)."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def run_rank(spec: RankSpec) -> int:
    import torch.distributed as dist

    from loom.distributed.command_ring import CommandRing
    from loom.distributed.launch import destroy, init_rank
    from loom.distributed.progress import StepProgress
    from loom.plugin_api import default_registry

    from .rank_commands import (
        CaptureGraphs,
        Envelope,
        Execute,
        ExecuteForward,
        FreeKvCache,
        InitKvCache,
        ProfileEnd,
        ProfileStart,
        Sample,
        Stop,
    )
    from .worker import Worker

    group = init_rank(spec.rank, spec.world_size, spec.port, spec.device, spec.config.shard_start_timeout)
    progress = StepProgress(Path(spec.progress_path), spec.world_size)
    ring = CommandRing(Path(spec.ring_path), spec.world_size, spec.rank) if spec.ring_path else None

    def next_command() -> Any:
        if ring is None:
            return broadcast_command(None, group)
        return ring.recv(lambda: broadcast_command(None, group))  # a large command comes over gloo

    error: str | None = None
    worker: Worker | None = None
    try:
        worker = Worker(spec.config, default_registry())
    except Exception as exc:  # every rank learns it below; rank 0 reports it
        error = f"{type(exc).__name__}: {exc}"
        log.error("rank failed to load the model", rank=spec.rank, error=error)
    errors: list[Any] = [None] * spec.world_size
    dist.all_gather_object(errors, error, group=group)
    if worker is None or any(errors):
        return 1
    log.info("rank ready", rank=spec.rank, world_size=spec.world_size, device=spec.device)
    launched: Any = None
    forwarded: Any = None  # an ExecuteForward's step, until its Sample
    profile_base = 0
    while True:
        envelope: Envelope = next_command()
        cmd = envelope.command
        if isinstance(cmd, Stop):
            progress.mark_done(spec.rank, envelope.seq)
            break
        try:
            if isinstance(cmd, Execute):
                step = worker.execute(cmd.plan)
                if launched is not None:  # read the previous step back (its buffers are reused)
                    worker.finish(launched)
                launched = step
            elif isinstance(cmd, ExecuteForward):
                forwarded = worker.execute_forward(cmd.plan)
                if launched is not None:
                    worker.finish(launched)
                launched = None
            elif isinstance(cmd, Sample):
                if forwarded is None:
                    raise RuntimeError("Sample without the forward it samples (that forward failed)")
                launched, forwarded = worker.sample(forwarded, cmd.bitmask), None
            elif isinstance(cmd, InitKvCache):
                launched = None
                worker.init_kv_cache(cmd.num_blocks)
            elif isinstance(cmd, FreeKvCache):
                launched = None
                worker.free_kv_cache()
            elif isinstance(cmd, CaptureGraphs):
                worker.capture_cuda_graphs(cmd.max_model_len, cmd.query_lens)
            elif isinstance(cmd, ProfileStart):
                profile_base = worker.profile_start()
            elif isinstance(cmd, ProfileEnd):
                launched = None
                dist.gather_object(worker.profile_end(profile_base), None, dst=0, group=group)
            else:
                raise TypeError(f"unknown rank command {cmd!r}")
        except Exception as exc:
            launched = forwarded = None
            log.warning("rank command failed (rank 0 fails the same way and handles it)", rank=spec.rank,
                        command=type(cmd).__name__, error=repr(exc))
        progress.mark_done(spec.rank, envelope.seq)
    progress.close()
    if ring is not None:
        ring.close()
    destroy()
    log.info("rank stopped", rank=spec.rank)
    return 0


def main() -> None:
    spec: RankSpec = pickle.loads(sys.stdin.buffer.read())
    die_with_parent(spec.parent_pid)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    from loom.logging_setup import configure_logging

    configure_logging(json_output=spec.log_json, level=spec.log_level, process=f"rank{spec.rank}")
    sys.exit(run_rank(spec))


if __name__ == "__main__":
    main()
