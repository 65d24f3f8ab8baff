"""Logits processors: one small object per transformation of the step's [N, V] float32 logits.

Each is built for a step only when some row needs it, from that step's per-row tensors, and
leaves the rows that do not use it bit-identical. Two lists run, in order (see
:mod:`loom.sample.sampler`): the *processors* shape the distribution that is reported (a
grammar's token bitmask, EOS / stop suppression, repetition, frequency and presence penalties,
temperature), the *filters* then narrow what sampled rows draw from (top_k, top_p, typical_p,
min_p). A new processor is a new class appended to a list; the sampler stays as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from . import cpu_bitmask


class LogitsProcessor(Protocol):
    def __call__(self, logits: torch.Tensor) -> torch.Tensor: ...  # [N, V] float32 -> [N, V] float32


def apply_processors(logits: torch.Tensor, processors: list[LogitsProcessor]) -> torch.Tensor:
    for p in processors:
        logits = p(logits)
    return logits


class Suppression:
    """Bans tokens (EOS and stop ids of rows before their min_new_tokens): -inf at flat indices
    row * V + token, scattered on the device; no dense [N, V] mask is built."""

    def __init__(self, flat_ids: torch.Tensor) -> None:
        self.flat_ids = flat_ids  # [K] int64

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.reshape(-1).index_fill(0, self.flat_ids, float("-inf")).view_as(logits)


class RepetitionPenalty:
    """Tokens seen in the prompt or output: negative logits multiplied, positive ones divided."""

    def __init__(self, penalty: torch.Tensor, seen: torch.Tensor) -> None:
        self.penalty = penalty  # [N, 1], 1.0 when off
        self.seen = seen  # [N, V] bool

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        pen = self.penalty
        return torch.where(self.seen, torch.where(logits < 0, logits * pen, logits / pen), logits)


class FrequencyPresencePenalty:
    """Minus frequency * count and presence * (count > 0), counting output tokens only."""

    def __init__(self, frequency: torch.Tensor, presence: torch.Tensor, counts: torch.Tensor) -> None:
        self.frequency = frequency  # [N, 1], 0.0 when off
        self.presence = presence  # [N, 1], 0.0 when off
        self.counts = counts  # [N, V] float32

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits - self.frequency * self.counts
        return logits - self.presence * (self.counts > 0).to(logits.dtype)


class TokenBitmask:
    """A grammar's allowed tokens (structured output): in logits rows ``rows``, every token whose
    bit is 0 in its ``bitmask`` row gets -inf; other rows are untouched and cost nothing.

    Bit j of int32 word w of a row stands for token 32w + j (xgrammar's layout). Masks in place,
    with Loom's word-wise C++ kernel on the CPU (``cpu_bitmask``) and xgrammar's Triton kernel on
    CUDA (xgrammar's C++ kernel, then plain torch, where those do not run): one pass over the masked rows and no copy of the logits (a copy cost as much as
    the masking itself on the CPU). It is the first processor, so what it masks is the step's own
    logits tensor, which nothing else reads. Masking commutes with the penalties and temperature,
    and the reported logprobs are those of the constrained distribution.
    """

    def __init__(self, bitmask: torch.Tensor, rows: torch.Tensor | None, row_list: list[int]) -> None:
        self.bitmask = bitmask  # [G, ceil(V / 32)] int32, on the logits' device
        # [G] int64 on the device: the logits row of each bitmask row, ascending; None when the
        # rows are every logits row (0..N-1), which the masking then does not read
        self.rows = rows
        self.row_list = row_list  # the same on the host

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        n, words = logits.shape[0], self.bitmask.shape[1]
        if len(self.row_list) == n:  # every row: rows are 0..N-1 in order
            bitmask_inplace(logits, self.bitmask, None, None)
            return logits
        # xgrammar's kernels read the bitmask row of each logits row they mask: spread the G rows
        # into an [N, W] bitmask (N x W int32: small next to the logits).
        assert self.rows is not None, "the row indices are left out only when every row is masked"
        full = torch.full((n, words), -1, dtype=torch.int32, device=logits.device)
        full.index_copy_(0, self.rows, self.bitmask)
        bitmask_inplace(logits, full, self.rows, self.row_list)
        return logits


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[G, ceil(V / 32)] int32 -> [G, V] bool: True where the token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [G, W, 32]; >> is arithmetic, & 1 keeps bit j
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


_Kernel = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", "list[int] | None"], None]


def _torch_kernel(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None,
                  row_list: list[int] | None) -> None:
    vocab = logits.shape[-1]
    if rows is None:
        logits.masked_fill_(~unpack_bitmask(bitmask, vocab), float("-inf"))
    else:
        sub = logits.index_select(0, rows).masked_fill_(~unpack_bitmask(bitmask.index_select(0, rows), vocab),
                                                        float("-inf"))
        logits.index_copy_(0, rows, sub)


_KERNELS: dict[str, _Kernel] = {}


def bitmask_kernel(device_type: str) -> _Kernel:
    """In-place masking of [N, V] float32 logits by an [N, W] bitmask on ``device_type``, of the
    rows given (all when None): xgrammar's kernel when it loads (imported on first use), else torch."""
    kernel = _KERNELS.get(device_type)
    if kernel is not None:
        return kernel
    kernel = _torch_kernel
    try:
        if device_type == "cpu" and cpu_bitmask.available():
            # Loom's word-wise kernel (sample/csrc/cpu_bitmask.cpp): several times xgrammar's on
            # a grammar's masks, which are mostly whole words of ones or zeros.
            def kernel(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None,
                       row_list: list[int] | None) -> None:
                cpu_bitmask.apply_bitmask_(logits, bitmask, rows)
        elif device_type == "cpu":
            from xgrammar.kernels.apply_token_bitmask_inplace_cpu import apply_token_bitmask_inplace_cpu

            def kernel(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None,
                       row_list: list[int] | None) -> None:
                apply_token_bitmask_inplace_cpu(logits, bitmask, logits.shape[-1], row_list)
        elif device_type == "cuda":
            from xgrammar.kernels.apply_token_bitmask_inplace_triton import apply_token_bitmask_inplace_triton

            def kernel(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None,
                       row_list: list[int] | None) -> None:
                apply_token_bitmask_inplace_triton(logits, bitmask, logits.shape[-1], rows)
    except ImportError:
        kernel = _torch_kernel
    _KERNELS[device_type] = kernel
    return kernel


def bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None,
                    row_list: list[int] | None = None) -> None:
    """-inf where the bit is 0, in place: [N, V] float32 logits, an [N, ceil(V / 32)] int32 bitmask
    on the same device; only ``rows`` (device tensor and host list alike) when given."""
    bitmask_kernel(logits.device.type)(logits, bitmask, rows, row_list)


class Temperature:
    """Each row divided by its temperature (greedy rows by 1.0, which is exact)."""

    def __init__(self, temperature: torch.Tensor) -> None:
        self.temperature = temperature  # [N, 1]

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return logits / self.temperature


# The filters: a removed token's logit becomes the dtype's lowest finite value (never -inf, so
# the finite check before them still holds after them).


class TopK:
    def __init__(self, top_k: torch.Tensor) -> None:
        self.top_k = top_k  # [N, 1] int64, vocab size when off

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        kth = torch.sort(logits, dim=-1, descending=True).values.gather(1, (self.top_k - 1).clamp(min=0))
        return logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)


class TopP:
    def __init__(self, top_p: torch.Tensor) -> None:
        self.top_p = top_p  # [N, 1], 1.0 when off

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        sorted_logits, sorted_idx = torch.sort(logits, dim=-1)  # ascending
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove = cum <= (1 - self.top_p)
        remove[:, -1] = False  # always keep the most likely token
        remove &= self.top_p < 1.0
        return logits.masked_fill(remove.scatter(1, sorted_idx, remove), torch.finfo(logits.dtype).min)


class TypicalP:
    def __init__(self, typical_p: torch.Tensor) -> None:
        self.typical_p = typical_p  # [N, 1], 1.0 when off

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        logp = logits.log_softmax(-1)
        ent = -(logp * logp.exp()).nansum(-1, keepdim=True)
        shifted = (-logp - ent).abs()
        sorted_scores, sorted_idx = torch.sort(shifted, dim=-1)
        cum = logits.gather(-1, sorted_idx).softmax(-1).cumsum(-1)
        last = (cum < self.typical_p).sum(dim=1, keepdim=True).clamp(max=logits.shape[-1] - 1)
        remove = sorted_scores > sorted_scores.gather(1, last)
        remove[:, 0] = False
        remove &= self.typical_p < 1.0
        return logits.masked_fill(remove.scatter(1, sorted_idx, remove), torch.finfo(logits.dtype).min)


class MinP:
    def __init__(self, min_p: torch.Tensor) -> None:
        self.min_p = min_p  # [N, 1], 0.0 when off

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        probs = logits.softmax(-1)
        remove = probs < self.min_p * probs.max(dim=-1, keepdim=True).values
        return logits.masked_fill(remove, torch.finfo(logits.dtype).min)
