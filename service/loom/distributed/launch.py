"""Setting up torch.distributed for the ranks of one host.

The engine process (rank 0) picks a free loopback port and starts the other ranks; every rank
then joins the process group there (``tcp://127.0.0.1:PORT``): NCCL when the ranks run on GPUs,
one GPU each (rank r takes the r-th GPU that ``CUDA_VISIBLE_DEVICES`` leaves visible), gloo on
the CPU. The step plans travel over a gloo group in both cases (``control_group``): they are
host objects, and NCCL would first copy them to a GPU.

NVLink multicast (NVLS in NCCL, PyTorch's symmetric memory) stays off in every rank
(``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``): on the lent machines it needs a
fabric manager set-up that is not there, and NCCL falls back to it badly.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch

from .parallel_state import init_tensor_parallel, reset_tensor_parallel

# Set in the engine process before its own init and in every rank process it starts.
RANK_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it; rank 0's store binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def apply_rank_env() -> None:
    os.environ.update(RANK_ENV)


def rank_device(device: str, rank: int) -> str:
    """The device rank ``rank`` runs on: ``cuda:RANK`` on GPUs, the CPU otherwise."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return f"cuda:{rank}" if device == "cuda" else device


def init_rank(rank: int, world_size: int, port: int, device: str, timeout_s: float) -> Any:
    """Join the process group and set this process's tensor-parallel state; the gloo group that
    carries the step plans is returned (the default group when it is gloo already)."""
    import torch.distributed as dist

    apply_rank_env()
    on_gpu = device.startswith("cuda")
    if on_gpu:
        torch.cuda.set_device(torch.device(device))
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world_size, timeout=timeout,
                            device_id=torch.device(device) if on_gpu else None)
    init_tensor_parallel()
    return dist.new_group(backend="gloo", timeout=timeout) if on_gpu else dist.group.WORLD


def destroy() -> None:
    import torch.distributed as dist

    reset_tensor_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
