"""Small unsigned integers packed into int32 words, as GPTQ and AWQ checkpoints store them.

A word holds ``32 / bits`` values; value j of a word sits at bits ``j*bits .. (j+1)*bits - 1``
(lowest first). GPTQ packs consecutive *rows* of a ``[rows, cols]`` matrix into one word (its
``qweight`` is ``[in / f, out]``) and consecutive columns for its zeros; AWQ packs consecutive
columns, but a word's 8 values are columns ``0, 2, 4, 6, 1, 3, 5, 7`` of its group of 8
(:data:`AWQ_ORDER`): value j of a word is column ``AWQ_ORDER[j]``.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's 4-bit word: slot j holds column AWQ_ORDER[j] of its 8
AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)  # column c of a group of 8 sits in slot AWQ_REVERSE[c]
SUPPORTED_BITS = (2, 4, 8)  # widths that fill an int32 word exactly


def per_word(bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{bits}-bit values do not fill int32 words (supported: {SUPPORTED_BITS})")
    return 32 // bits


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 32, bits, dtype=torch.int32, device=device)


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``[R, C]`` int32 -> ``[R * 32/bits, C]`` int32: word (r, c) holds rows ``r*f .. r*f + f - 1``."""
    f = per_word(bits)
    values = (packed.unsqueeze(1) >> _shifts(bits, packed.device).view(1, f, 1)) & ((1 << bits) - 1)
    return values.reshape(packed.shape[0] * f, packed.shape[1])


def unpack_cols(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """``[R, C]`` int32 -> ``[R, C * 32/bits]`` int32; ``order``: slot j holds column ``order[j]``
    of its word's group (None: slot j is column j)."""
    f = per_word(bits)
    values = (packed.unsqueeze(2) >> _shifts(bits, packed.device).view(1, 1, f)) & ((1 << bits) - 1)
    if order is not None:  # values[..., j] is column order[j]: put column c at position c
        values = values[..., list(_inverse(order))]
    return values.reshape(packed.shape[0], packed.shape[1] * f)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`unpack_rows`: ``[R, C]`` values in ``[0, 2^bits)`` -> ``[R / f, C]`` int32."""
    f = per_word(bits)
    if values.shape[0] % f:
        raise ValueError(f"{values.shape[0]} rows do not fill whole words of {f}")
    v = values.to(torch.int64).reshape(values.shape[0] // f, f, values.shape[1])
    words = (v << _shifts(bits, values.device).to(torch.int64).view(1, f, 1)).sum(dim=1)
    return _to_int32(words)


def pack_cols(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Inverse of :func:`unpack_cols`: ``[R, C]`` -> ``[R, C / f]`` int32."""
    f = per_word(bits)
    if values.shape[1] % f:
        raise ValueError(f"{values.shape[1]} columns do not fill whole words of {f}")
    v = values.to(torch.int64).reshape(values.shape[0], values.shape[1] // f, f)
    if order is not None:  # slot j takes column order[j]
        v = v[..., list(order)]
    words = (v << _shifts(bits, values.device).to(torch.int64).view(1, 1, f)).sum(dim=2)
    return _to_int32(words)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> the same bits as int32."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    inverse = [0] * len(order)
    for slot, column in enumerate(order):
        inverse[column] = slot
    return tuple(inverse)
