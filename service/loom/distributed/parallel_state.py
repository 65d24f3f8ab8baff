"""The tensor-parallel rank and world size that layers are built for, and their collectives.

One process serves the whole model today: the world size is 1, every layer holds full tensors
and the collectives below return their input untouched. A worker per rank calls
:func:`init_tensor_parallel` (after ``torch.distributed.init_process_group``) before building the
model; layers read the rank and size once, at construction, so the same model code serves both.

:func:`tensor_parallel_as` builds layers as one rank of a larger group without any process group:
the weight loaders' sharding can then be checked (and used) in one process; only the forward's
collectives need real peers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TensorParallelState:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup; None: the default group (or no peers)


_state = TensorParallelState()


def get_tp_rank() -> int:
    return _state.rank


def get_tp_size() -> int:
    return _state.size


def init_tensor_parallel(group: Any = None) -> None:
    """Take rank and size from ``torch.distributed`` (initialised by the caller) for ``group``."""
    import torch.distributed as dist

    global _state
    if not dist.is_initialized():
        raise RuntimeError("init_tensor_parallel needs torch.distributed.init_process_group first")
    _state = TensorParallelState(dist.get_rank(group), dist.get_world_size(group), group)


def reset_tensor_parallel() -> None:
    """Back to one rank of one (after the process group is destroyed)."""
    global _state
    _state = TensorParallelState()


@contextlib.contextmanager
def tensor_parallel_as(rank: int, size: int) -> Iterator[None]:
    """Layers built inside this block are rank ``rank`` of ``size`` (no process group needed)."""
    global _state
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a group of {size}")
    saved = _state
    _state = TensorParallelState(rank, size, None)
    try:
        yield
    finally:
        _state = saved


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t`` over the ranks, in place; ``t`` itself when there is one rank."""
    if _state.size == 1:
        return t
    import torch.distributed as dist

    dist.all_reduce(t, group=_state.group)
    return t


def all_gather_last_dim(t: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` on each rank -> ``[..., size * n]``, rank r's part at columns ``r*n:(r+1)*n``."""
    if _state.size == 1:
        return t
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(_state.size)]
    dist.all_gather(parts, t.contiguous(), group=_state.group)
    return torch.cat(parts, dim=-1)
