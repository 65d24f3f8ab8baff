"""Rotary position embeddings (rotate-half / NeoX layout, as HF Llama), built from a HF config.

Reads both config styles: transformers 4 (``rope_theta`` + ``rope_scaling``) and transformers 5
(``rope_parameters = {"rope_theta": ..., "rope_type": ...}``), and transformers 5's per-layer-type
dicts (Gemma 3: ``{"sliding_attention": {...}, "full_attention": {...}}``, one table each, chosen
by ``layer_type``). Supported types: default, linear, dynamic, llama3, yarn, longrope (``su``).
cos/sin are cached in float32 for every position up to the model's maximum, so applying RoPE is a
gather plus elementwise math (no per-step trig). On CUDA that math is one fused kernel for q and k
(``fused_ops.rotary``), rounding as the torch code here does; a model that normalises each head of
q and k first (Qwen3, Gemma 3) calls ``forward_with_qk_norm``, one kernel for both norms and the
rotation (``fused_ops.qk_norm_rotary``).

``partial_rotary_factor`` < 1 (Phi-4-mini) rotates only the first ``head_dim * factor`` dimensions
of each head (the torch path; the fused kernels rotate whole heads).

LongRoPE (Phi-3 ``longrope``/``su``): transformers rotates a whole sequence with the long factors
once it is longer than ``original_max_position_embeddings`` (Phi-3's ``generate`` even drops its
cache and re-encodes the sequence at that point), and with the short ones before. Here the
choice is per position: rows of the table below that length use the short factors, the others
the long ones, so a token's keys never depend on the batch nor on how long its sequence grows.
That equals transformers for every sequence within the original length (the usual 4k of Phi-3
128k); a longer sequence keeps its first positions' short-factor keys where transformers would
re-encode them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loom import kernel_switches
from loom.layers import cpu_fused, fused_ops
from loom.layers.norm import GemmaRMSNorm, RMSNorm

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """One flat dict with at least ``rope_type`` and ``rope_theta``, whatever the config style.

    Per-layer-type parameters (a dict of dicts) are read for ``layer_type``; a flat dict serves
    every layer type.
    """
    params: dict[str, Any] = {}
    for attr in ("rope_scaling", "rope_parameters"):  # in transformers 5 these are the same dict
        value = getattr(config, attr, None)
        if isinstance(value, dict):
            params.update(value)
    if any(isinstance(v, dict) for v in params.values()):
        if layer_type is None or not isinstance(params.get(layer_type), dict):
            raise ValueError(f"the RoPE parameters are per layer type ({', '.join(sorted(params))}); "
                             f"layer type {layer_type!r} has none")
        params = dict(params[layer_type])
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if params["rope_type"] == "su":  # Phi-3's first name for LongRoPE
        params["rope_type"] = "longrope"
    params["rope_theta"] = float(params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0)
    if "partial_rotary_factor" not in params:
        params["partial_rotary_factor"] = float(getattr(config, "partial_rotary_factor", None) or 1.0)
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        # HF's rule: a top-level original_max_position_embeddings (Phi-3 style) wins; otherwise
        # the pre-training length defaults to the (extended) max_position_embeddings.
        top_level = getattr(config, "original_max_position_embeddings", None)
        if top_level is not None:
            params["original_max_position_embeddings"] = top_level
        params.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    return params


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:  # [D/2] float32
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / dim
    return 1.0 / (theta**exponents)


def _llama3_inv_freq(base: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / base
    # Long wavelengths (low frequencies) are interpolated by `factor`, short ones kept, and
    # the band in between blended smoothly.
    scaled = torch.where(wavelen > old_len / low, base / factor, base)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, blended, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(
    params: dict[str, Any], dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    theta = params["rope_theta"]
    orig_len = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / orig_len
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength completes `num_rotations` turns over the original length.
        return (dim * math.log(orig_len / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp  # 1: keep the original frequency, 0: interpolate fully
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    inv_freq = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
    return inv_freq, float(attention_factor)


def _longrope_inv_freqs(params: dict[str, Any], dim: int,
                        max_position_embeddings: int) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """(short inverse frequencies, long ones [D/2] float32, cos/sin scaling, the first position
    of the long ones), as transformers computes LongRoPE's."""
    theta = params["rope_theta"]
    orig_len = int(params["original_max_position_embeddings"])
    short = torch.tensor(params["short_factor"], dtype=torch.float32)
    long = torch.tensor(params["long_factor"], dtype=torch.float32)
    if short.shape != (dim // 2,) or long.shape != (dim // 2,):
        raise ValueError(f"LongRoPE needs {dim // 2} short and long factors, got {short.numel()} and {long.numel()}")
    factor = params.get("factor") or max_position_embeddings / orig_len
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig_len))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    base = theta**exponents
    return 1.0 / (short * base), 1.0 / (long * base), float(attention_factor), orig_len


def compute_inv_freq(
    params: dict[str, Any], head_dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [D/2] float32 on CPU, cos/sin scaling) for normalised ``params``."""
    rope_type = params["rope_type"]
    base = _default_inv_freq(params["rope_theta"], head_dim)
    if rope_type == "default":
        return base, 1.0
    if rope_type == "linear":
        return base / float(params["factor"]), 1.0
    if rope_type == "dynamic":
        # Dynamic NTK only rescales beyond the original length and would make a position's
        # encoding depend on the current sequence length, which a shared KV cache cannot honour;
        # within the original length it equals the default, which is what we serve.
        return base, 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(base, params), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(params, head_dim, max_position_embeddings)
    if rope_type == "longrope":  # the short factors; get_rope adds the long ones past their start
        short, _, scaling, _ = _longrope_inv_freqs(params, head_dim, max_position_embeddings)
        return short, scaling
    raise ValueError(
        f"unsupported RoPE type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


class RotaryEmbedding(nn.Module):
    """Applies RoPE to ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` at ``positions [T]``.

    ``rotary_dim`` (default ``head_dim``): how many leading dimensions of a head rotate.
    ``long_inv_freq`` / ``long_from``: positions from ``long_from`` on use these frequencies
    instead (LongRoPE).
    """

    cos_cached: torch.Tensor
    sin_cached: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, inv_freq: torch.Tensor,
                 attention_scaling: float = 1.0, *, rotary_dim: int | None = None,
                 long_inv_freq: torch.Tensor | None = None, long_from: int | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        if self.rotary_dim % 2 or self.rotary_dim > head_dim:
            raise ValueError(f"rotary dimension {self.rotary_dim} must be even and at most head_dim {head_dim}")
        self.max_positions = max_positions
        # Built on CPU in float32 whatever the default device/dtype, so every device gets
        # bit-identical tables; HF computes them in float32 too.
        positions = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = positions[:, None] * inv_freq.to("cpu", torch.float32)[None, :]  # [P, R/2]
        if long_inv_freq is not None and long_from is not None and long_from < max_positions:
            long = positions[long_from:, None] * long_inv_freq.to("cpu", torch.float32)[None, :]
            freqs = torch.cat((freqs[:long_from], long))
        device = torch.get_default_device()
        self.register_buffer("cos_cached", (freqs.cos() * attention_scaling).to(device), persistent=False)
        self.register_buffer("sin_cached", (freqs.sin() * attention_scaling).to(device), persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = self.rotary_dim // 2
        x1, x2 = x[..., :half], x[..., half:self.rotary_dim]  # [T, H, R/2] each
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        if self.rotary_dim == self.head_dim:
            return rotated
        return torch.cat((rotated, x[..., self.rotary_dim:]), dim=-1)  # the rest passes through

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rotary_dim == self.head_dim:
            if fused_ops.rotary_supported(positions, q, k):  # CUDA: q and k in one kernel
                return fused_ops.rotary(positions, q, k, self.cos_cached, self.sin_cached)
            if cpu_fused.rotary_supported(positions, q, k):  # CPU float32: one C++ operator
                return cpu_fused.rotary(positions, q, k, self.cos_cached, self.sin_cached)
        cos = self.cos_cached[positions].unsqueeze(1)  # [T, 1, R/2]
        sin = self.sin_cached[positions].unsqueeze(1)
        # Cast to the activation dtype first, as HF does, so half precision rounds the same way.
        cos_q, sin_q = cos.to(q.dtype), sin.to(q.dtype)
        return self._rotate(q, cos_q, sin_q), self._rotate(k, cos_q.to(k.dtype), sin_q.to(k.dtype))

    def forward_with_qk_norm(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                             q_norm: RMSNorm | GemmaRMSNorm,
                             k_norm: RMSNorm | GemmaRMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """``self(positions, q_norm(q), k_norm(k))``: the per-head norms of q and k, then RoPE.

        On CUDA, for heads rotated whole, one kernel does all three (``fused_ops.qk_norm_rotary``,
        with the norm kernel's roundings); otherwise the norms and the rotation run as they do
        alone. A subclass of either norm (its own forward) is never fused.
        """
        gemma = type(q_norm) is GemmaRMSNorm
        if (type(q_norm) in (RMSNorm, GemmaRMSNorm) and type(k_norm) is type(q_norm)
                and self.rotary_dim == self.head_dim
                and fused_ops.qk_norm_rotary_supported(positions, q, k, q_norm.weight, k_norm.weight, gemma)):
            return fused_ops.qk_norm_rotary(positions, q, k, q_norm.weight, k_norm.weight, q_norm.eps, k_norm.eps,
                                            self.cos_cached, self.sin_cached, gemma)
        return self(positions, q_norm(q), k_norm(k))

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, max_positions={self.max_positions}"


@dataclass(frozen=True)
class RopeArgs:
    """What one kernel needs to apply a layer's RoPE, and the per-head norms before it, to its q
    and k: the positions ``[T]``, the float32 ``[P, D/2]`` cos / sin tables, and (``q_weight``
    not None) the norms' ``[D]`` weights and epsilons, Gemma's ``(1 + w)`` form when ``gemma``.
    The arithmetic is ``fused_ops.norm_rotate_head``'s (``qk_norm_rotary`` / ``rotary``)."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    q_weight: torch.Tensor | None = None
    k_weight: torch.Tensor | None = None
    q_eps: float = 0.0
    k_eps: float = 0.0
    gemma: bool = False


@dataclass(frozen=True)
class PendingRope:
    """A layer's RoPE (and the per-head norms of q and k before it) not yet applied: what a model
    hands ``Attention`` with its unrotated q and k, so that a backend that writes K/V into its
    pool may rotate them in the same kernel (``AttentionBackend.supports_rope_store``).
    :meth:`apply` is the model's own path; :meth:`kernel_args` says whether one kernel may do
    it instead, with the same bits."""

    rotary: RotaryEmbedding
    positions: torch.Tensor  # [T]
    q_norm: RMSNorm | GemmaRMSNorm | None = None
    k_norm: RMSNorm | GemmaRMSNorm | None = None

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [T, Hq, D]``, ``k [T, Hkv, D]`` normalised (where the layer does) and rotated."""
        if self.q_norm is not None and self.k_norm is not None:
            return self.rotary.forward_with_qk_norm(self.positions, q, k, self.q_norm, self.k_norm)
        return self.rotary(self.positions, q, k)

    def kernel_args(self, q: torch.Tensor, k: torch.Tensor) -> RopeArgs | None:
        """The arguments of one fused kernel for these operands, or None where only :meth:`apply`
        serves them: rotary dimensions short of the head, a norm of another type (a subclass has
        its own forward), operands the fused kernels do not take (not CUDA, ``LOOM_FUSED_KERNELS=0``,
        strided heads) or ``LOOM_ROPE_STORE=0``."""
        rot = self.rotary
        if not kernel_switches.rope_store or rot.rotary_dim != rot.head_dim:
            return None
        if self.q_norm is None or self.k_norm is None:
            if self.q_norm is not None or self.k_norm is not None or not fused_ops.rotary_supported(self.positions, q, k):
                return None
            return RopeArgs(self.positions, rot.cos_cached, rot.sin_cached)
        q_norm, k_norm = self.q_norm, self.k_norm
        gemma = type(q_norm) is GemmaRMSNorm
        if (type(q_norm) not in (RMSNorm, GemmaRMSNorm) or type(k_norm) is not type(q_norm)
                or not fused_ops.qk_norm_rotary_supported(self.positions, q, k, q_norm.weight, k_norm.weight, gemma)):
            return None
        return RopeArgs(self.positions, rot.cos_cached, rot.sin_cached, q_norm.weight, k_norm.weight,
                        q_norm.eps, k_norm.eps, gemma)


def get_rope(config: Any, head_dim: int, max_positions: int | None = None,
             layer_type: str | None = None) -> RotaryEmbedding:
    """The rotary embedding a HF config describes (for the layers of ``layer_type`` when its
    parameters are per layer type), cached for ``max_positions`` positions."""
    params = rope_parameters(config, layer_type)
    max_pos = int(config.max_position_embeddings)
    rotary_dim = int(head_dim * float(params["partial_rotary_factor"]))
    if params["rope_type"] == "longrope":
        short, long, scaling, long_from = _longrope_inv_freqs(params, rotary_dim, max_pos)
        return RotaryEmbedding(head_dim, max_positions or max_pos, short, scaling, rotary_dim=rotary_dim,
                               long_inv_freq=long, long_from=long_from)
    inv_freq, scaling = compute_inv_freq(params, rotary_dim, max_pos)
    return RotaryEmbedding(head_dim, max_positions or max_pos, inv_freq, scaling, rotary_dim=rotary_dim)
