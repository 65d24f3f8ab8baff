"""Built-in attention backends.

Each backend is one :class:`AttentionBackendSpec` in :data:`BACKENDS`; ``load`` imports the
implementation lazily so that listing plugins never imports a kernel library. Add a backend
by appending its spec here.
"""

from __future__ import annotations

from collections.abc import Iterable

from loom.plugin_api import AttentionBackendSpec, hookimpl


def _load_torch() -> type:
    from .torch_backend import TorchAttentionBackend

    return TorchAttentionBackend


BACKENDS: list[AttentionBackendSpec] = [
    AttentionBackendSpec(
        name="torch",
        summary="PyTorch SDPA over the paged KV cache; runs on CPU and CUDA, the reference backend",
        load=_load_torch,
        devices=("cpu", "cuda"),
        priority=0,
    ),
]


@hookimpl
def loom_attention_backends() -> Iterable[AttentionBackendSpec]:
    return list(BACKENDS)
