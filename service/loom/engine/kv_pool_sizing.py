"""How many KV blocks the pool gets on the CPU, and why.

On the GPU the pool takes what the weights and a warm-up's activations leave (see
``LLMEngine._size_pool_on_gpu``). On the CPU there is no such bound worth taking: the pool would
be allocated (and touched, so resident) out of the machine's RAM, which the rest of the machine
needs. So by default it holds what the limits need: ``sequences`` requests at full length
(``max_total_tokens`` each), or the configured ``--max-batch-size`` if that is fewer, and at most
``memory_fraction`` of the memory available at start; never less than one full-length request.
``--max-batch-total-tokens`` overrides all of it.

For the default model (SmolLM2-135M, 30 layers x 3 KV heads x 64 dims, fp32: 45 KiB a token)
that is 4 x 4,096 tokens = 720 MiB, where a fixed 65,536-token pool took 2.8 GiB.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class KvPoolSize:
    blocks: int
    block_size: int
    bytes_per_token: int
    reason: str  # why this size, for the start-up log

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size

    @property
    def bytes(self) -> int:
        return self.tokens * self.bytes_per_token


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, element_size: int) -> int:
    """K and V of one token in every layer."""
    return 2 * num_layers * num_kv_heads * head_dim * element_size


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def available_memory_bytes() -> int | None:
    """Memory this process can still take: the kernel's MemAvailable, lowered to what is left of a
    cgroup limit (a container's) when there is one. None when neither can be read."""
    candidates: list[int] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                candidates.append(int(line.split()[1]) * 1024)
                break
    except (OSError, ValueError, IndexError):
        pass
    if not candidates and hasattr(os, "sysconf"):
        with contextlib.suppress(ValueError, OSError):
            candidates.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    for limit_file, usage_file in (("memory.max", "memory.current"),  # cgroup v2
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):  # v1
        limit = _read_int(Path("/sys/fs/cgroup") / limit_file)
        usage = _read_int(Path("/sys/fs/cgroup") / usage_file)
        if limit is not None and usage is not None and limit < 1 << 60:  # v1 writes a huge number for none
            candidates.append(max(0, limit - usage))
            break
    return min(candidates) if candidates else None


def size_cpu_kv_pool(*, block_size: int, max_model_len: int, bytes_per_token: int,
                     explicit_tokens: int | None, sequences: int, max_batch_size: int | None,
                     memory_fraction: float, available_bytes: int | None) -> KvPoolSize:
    """The CPU pool: ``explicit_tokens`` (``--max-batch-total-tokens``) when set; else enough for
    ``min(sequences, max_batch_size)`` sequences of ``max_model_len`` tokens, capped at
    ``memory_fraction`` of ``available_bytes``, and never below one sequence of ``max_model_len``."""

    def blocks_for(tokens: int) -> int:
        return max(1, -(-tokens // block_size))

    if explicit_tokens:
        return KvPoolSize(max(1, explicit_tokens // block_size), block_size, bytes_per_token,
                          "--max-batch-total-tokens")
    seqs = min(sequences, max_batch_size) if max_batch_size else sequences
    wanted = seqs * max_model_len
    why = f"{seqs} sequences of max_total_tokens {max_model_len}"
    if max_batch_size and max_batch_size < sequences:
        why += " (--max-batch-size)"
    if available_bytes is None:
        return KvPoolSize(blocks_for(wanted), block_size, bytes_per_token, why + "; available memory unknown")
    budget_tokens = int(available_bytes * memory_fraction) // bytes_per_token
    share = f"{memory_fraction:.0%} of the {available_bytes >> 20} MiB available"
    if wanted <= budget_tokens:
        return KvPoolSize(blocks_for(wanted), block_size, bytes_per_token, f"{why}, within {share}")
    if budget_tokens >= max_model_len:  # whole blocks within the budget, one full sequence at least
        blocks = max(budget_tokens // block_size, blocks_for(max_model_len))
        return KvPoolSize(blocks, block_size, bytes_per_token, f"{share} (less than {why})")
    return KvPoolSize(blocks_for(max_model_len), block_size, bytes_per_token,
                      f"one sequence of max_total_tokens {max_model_len}, more than {share}")
