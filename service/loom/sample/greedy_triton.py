"""The greedy pick of a whole step in one launch: for every row of processed logits ``[N, V]``,
the first index of its largest value, that token's log-probability and whether the row is
finite, which the sampler otherwise computes in six launches (``amax``, ``isfinite``,
``log_softmax``, ``argmax``, ``gather`` and a copy).

Why: at batch 1 torch's ``log_softmax`` gives a row to one thread block, so a 151,936-word row
takes ~33 us on the H200, and the six launches ~58 us of a 3.1 ms Qwen3-30B-A3B decode step
(``bench/results/profile-random-qwen3-30b-a3b-b1-pdl.txt``); at batch 256 they read and write
the ``[N, V]`` float32 logits about five times. Here each row is cut into ``BLOCK``-wide pieces,
one program a piece, which stores its piece's maximum, the first index reaching it, the sum of
``exp(x - max)`` over the piece and whether it held a NaN. The program of a row that finishes
last (:func:`loom.layers.split_k.last_to_arrive`) merges the row's pieces in piece order:

- the token: the first piece reaching the row's maximum, and its first index there, i.e. the
  row's first maximal index, as ``torch.argmax`` picks it;
- the log-probability: ``x[token] - max - log(sum)`` with ``x[token] = max``, i.e. ``-log(sum)``
  where ``sum = sum_p s_p * exp(m_p - max)``; the same value as ``log_softmax`` up to the
  rounding of the sum's order (a few ulps);
- finite: no NaN and a finite maximum (a row of -inf, or one holding +inf or NaN, is not).

The merge reads the pieces in a fixed order, so the results do not depend on which program was
last. NaNs are left out of the maximum (the row is reported non-finite, and its request fails,
whatever token it names).

Used by :class:`loom.sample.sampler.Sampler` where no row of the step samples and none asks for
alternatives, on CUDA (and in Triton's interpreter, for the CPU tests); ``LOOM_GREEDY_KERNEL=0``
keeps the six launches (``kernel_switches.greedy_kernel``).
"""

# mypy: disable-error-code="no-untyped-def"
# (Triton kernels take untyped pointer arguments; annotations there would change their meaning.)
from __future__ import annotations

import torch

from loom import kernel_switches
from loom.layers.split_k import last_to_arrive
from loom.layers.triton_jit import interpreting
from loom.layers.triton_jit import jit as _jit

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

BLOCK = 2048  # logits a program reads (8 KB of float32): 63 pieces of Llama 3's 128,256-word rows
MAX_PIECES = 256  # pieces a row may have: rows of up to 524,288 words (Gemma 3 has 262,208)
MAX_ROWS = 16384  # rows a launch may have (one counter each)

_counters: dict[tuple[str, int], torch.Tensor] = {}


@_jit
def _greedy_kernel(
    logits_ptr,  # [N, V] float32, unit stride along V
    part_max_ptr, part_sum_ptr,  # [N, PIECES] float32: each piece's maximum and sum of exp(x - max)
    part_idx_ptr, part_nan_ptr,  # [N, PIECES] int32: the first index of the maximum in the piece, NaN seen
    counter_ptr,  # [N] int32, zero before and after the launch
    token_ptr,  # [N] int64
    logprob_ptr,  # [N] float32
    finite_ptr,  # [N] bool
    V, PIECES, stride_row,
    BLOCK: tl.constexpr, BLOCK_P: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    cols = p * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + r * stride_row + cols, mask=cols < V, other=float("-inf"))
    nan = x != x
    x = tl.where(nan, float("-inf"), x)
    m, i = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    # A piece of -inf sums nothing (exp(-inf - 0)); a piece holding +inf makes its row
    # non-finite, whatever its sum.
    s = tl.sum(tl.exp(x - tl.where(m == float("-inf"), 0.0, m)), axis=0)
    at = r * PIECES + p
    tl.store(part_max_ptr + at, m)
    tl.store(part_sum_ptr + at, s)
    tl.store(part_idx_ptr + at, i.to(tl.int32))
    tl.store(part_nan_ptr + at, tl.max(nan.to(tl.int32), axis=0))
    if last_to_arrive(counter_ptr + r, PIECES):
        q = tl.arange(0, BLOCK_P)
        live = q < PIECES
        row = r * PIECES
        pm = tl.load(part_max_ptr + row + q, mask=live, other=float("-inf"), cache_modifier=".cg")
        ps = tl.load(part_sum_ptr + row + q, mask=live, other=0.0, cache_modifier=".cg")
        pn = tl.load(part_nan_ptr + row + q, mask=live, other=0, cache_modifier=".cg")
        best = tl.max(pm, axis=0)
        # The first piece reaching the maximum holds the row's first maximal index.
        # (A row of -inf and NaN only: every piece's maximum is -inf, so the first piece.)
        first = tl.min(tl.where(pm == best, q, BLOCK_P), axis=0)
        idx = tl.load(part_idx_ptr + row + first, cache_modifier=".cg")
        total = tl.sum(tl.where(pm == float("-inf"), 0.0, ps * tl.exp(pm - tl.where(best == float("-inf"), 0.0, best))),
                       axis=0)
        finite = (tl.max(pn, axis=0) == 0) & (best < float("inf")) & (best > float("-inf"))
        tl.store(token_ptr + r, first.to(tl.int64) * BLOCK + idx.to(tl.int64))
        tl.store(logprob_ptr + r, -tl.log(total))
        tl.store(finite_ptr + r, finite)


def serves(logits: torch.Tensor) -> bool:
    """Whether :func:`greedy_pick` takes these processed logits: float32 ``[N, V]`` with unit
    stride along V, 1 to ``MAX_ROWS`` rows of at most ``BLOCK * MAX_PIECES`` words, on CUDA (or
    any device in Triton's interpreter), the switch on."""
    if not (HAS_TRITON and kernel_switches.greedy_kernel and kernel_switches.fused_kernels):
        return False
    if logits.device.type != "cuda" and not interpreting():
        return False
    return (logits.dim() == 2 and logits.dtype == torch.float32 and logits.stride(-1) == 1
            and 1 <= logits.shape[0] <= MAX_ROWS and 1 <= logits.shape[1] <= BLOCK * MAX_PIECES)


def _row_counters(device: torch.device) -> torch.Tensor:
    """This module's zeroed counters on ``device`` (its own: the sampler's launch shares no
    counter with a kernel of another stream)."""
    key = (device.type, device.index if device.index is not None else -1)
    buf = _counters.get(key)
    if buf is None:
        buf = torch.zeros(MAX_ROWS, dtype=torch.int32, device=device)
        _counters[key] = buf
    return buf


def greedy_pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(token_ids [N] int64, logprobs [N] float32, finite [N] bool)`` of processed logits
    ``[N, V]`` (see :func:`serves`): the first maximal index of each row, its log-probability
    under ``softmax(row)`` and whether the row is finite."""
    n, v = logits.shape
    pieces = triton.cdiv(v, BLOCK)
    dev = logits.device
    # The four partials of every piece in one allocation (the int32 ones as views of float32
    # rows: the same element size): this runs once a step.
    parts = torch.empty(4, n, pieces, dtype=torch.float32, device=dev)
    part_max, part_sum = parts[0], parts[1]
    part_idx, part_nan = parts[2].view(torch.int32), parts[3].view(torch.int32)
    token_ids = torch.empty(n, dtype=torch.int64, device=dev)
    logprobs = torch.empty(n, dtype=torch.float32, device=dev)
    finite = torch.empty(n, dtype=torch.bool, device=dev)
    _greedy_kernel[(n, pieces)](
        logits, part_max, part_sum, part_idx, part_nan, _row_counters(dev), token_ids, logprobs, finite,
        v, pieces, logits.stride(0), BLOCK=BLOCK, BLOCK_P=triton.next_power_of_2(pieces), num_warps=4,
    )
    return token_ids, logprobs, finite
