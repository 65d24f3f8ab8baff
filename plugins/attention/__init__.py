"""Built-in attention backends.

Each backend is one :class:`AttentionBackendSpec` in :data:`BACKENDS`; ``load`` imports the
implementation lazily so that listing plugins never imports a kernel library. Add a backend
by appending its spec here.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

from loom.plugin_api import AttentionBackendSpec, hookimpl, lazy_import


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _check_paged() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if not _cuda_available():
        return "CUDA is not available"
    return None


def _check_flash() -> str | None:
    if importlib.util.find_spec("flash_attn") is None:
        return "flash-attn is not installed"
    if not _cuda_available():
        return "CUDA is not available"
    return None


BACKENDS: list[AttentionBackendSpec] = [
    AttentionBackendSpec(
        name="torch",
        summary="PyTorch SDPA over the paged KV cache; runs on CPU and CUDA, the reference backend",
        load=lazy_import(__name__, ".torch_backend", "TorchAttentionBackend"),
        devices=("cpu", "cuda"),
        priority=0,
    ),
    AttentionBackendSpec(
        name="paged",
        summary="Triton paged attention (GQA-grouped decode with split-K, varlen prefill on cached "
        "context, sliding windows); CUDA-graph capturable decode",
        load=lazy_import(__name__, ".paged_triton", "PagedAttentionBackend"),
        check=_check_paged,
        devices=("cuda",),
        priority=10,
    ),
    AttentionBackendSpec(
        name="flash",
        summary="flash-attn 2 varlen prefill and decode over the paged KV cache (needs --block-size 256)",
        load=lazy_import(__name__, ".flash_attn_backend", "FlashAttentionBackend"),
        check=_check_flash,
        devices=("cuda",),
        priority=20,
        block_size_multiple=256,  # flash-attn 2's paged KV: chosen automatically only then
    ),
]


@hookimpl
def loom_attention_backends() -> Iterable[AttentionBackendSpec]:
    return list(BACKENDS)
