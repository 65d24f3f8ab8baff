"""Counter-based noise: the uniform for (seed, output position, token id) is a fixed hash.

A seeded request therefore picks the same tokens whatever it is batched with, after a preemption
and across restarts, with no per-row generator objects and no host sync.
"""

from __future__ import annotations

import torch

_MASK53 = (1 << 53) - 1
_BELOW_ONE = 1.0 - 2.0**-24  # the largest float32 below 1


def i64(x: int) -> int:
    """A 64-bit constant as a signed int64 (torch integer arithmetic wraps)."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = i64(0x9E3779B97F4A7C15), i64(0xBF58476D1CE4E5B9), i64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ _shr(x, 30)
    x = x * _MIX1
    x = x ^ _shr(x, 27)
    x = x * _MIX2
    return x ^ _shr(x, 31)


def counter_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniforms in (0, 1), [N, V] float32, a pure function of (seed[n], step[n], token id)."""
    base = _splitmix(seeds * _GOLDEN + steps * _MIX1)  # [N]
    ids = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    x = _splitmix(base[:, None] + ids[None, :] * _GOLDEN)  # [N, V]
    u = ((_shr(x, 11) & _MASK53).to(torch.float64) + 0.5).mul_(2.0**-53).to(torch.float32)
    # A draw within 2**-25 of 1 rounds to 1.0 in float32, and 1.0 is an infinite Gumbel noise
    # that would pick its token whatever its probability (one row in ~680 at 49,152 tokens).
    # Only those draws move, to the largest float32 below 1.
    return u.clamp_(max=_BELOW_ONE)
