"""The attention backend contract, for plugins: import it from ``loom.plugin_api``.

A backend subclasses :class:`AttentionBackend` with its own plan type, implements ``prepare``
(once per step) and ``forward`` (once per layer), and may override the CUDA-graph hooks
(``init_cuda_graph_state``, ``capture_metadata``, ``prepare_replay``) when it keeps device state
of its own. A backend that sets ``supports_fp8_kv_cache`` reads and writes the packed FP8 pool
whose format ``kv_fp8`` defines (quantize, views, write, read_blocks). This module imports torch; ``loom.plugin_api`` loads it only when one of these
names is first used, so listing plugins stays torch-free.
"""

from __future__ import annotations

from loom.layers import kv_fp8
from loom.layers.attention import AttentionBackend, AttentionMetadata, write_kv
from loom.layers.attention_graph import StaticAttentionBuffers

__all__ = ["AttentionBackend", "AttentionMetadata", "StaticAttentionBuffers", "kv_fp8", "write_kv"]
