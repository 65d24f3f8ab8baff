"""A draft model's catch-up steps as CUDA-graph replays: uniform widths by recomputing in front.

A draft call first computes what the draft has not seen: usually the target's last token and the
accepted drafts (1 or 2 tokens a sequence, served by the decode graphs of width 1 and 2), but
after a back-off every token the target decoded meanwhile (5, 9, 17, 33, 65 after back-offs of
4..64 steps). Eagerly such a step is host-bound: on the H200 an int4 llama-8b draft step took
25-50 ms whether it computed 5 tokens or 65 (32 layers of Triton launches), where a graphed
draft step takes 3.4 ms (W5 b, ``bench/results/gpu-llama-8b-w5b-int4-draft-3.json``).

**Design.** The draft captures graphs of a few more widths (query lengths) ``q``:
:data:`CATCH_UP_WIDTHS`, at the batch sizes its decode graphs have, up to
:data:`CATCH_UP_GRAPH_TOKENS` rows a graph. A step whose sequences have ``T_i`` new tokens is
laid out at the smallest captured width ``Q >= max T_i`` that every sequence can fill, by
starting each sequence ``Q - T_i`` positions early: those rows recompute tokens whose KV the
draft already holds, at their own positions, with slot ``-1``, so the attention's store skips
them (the pool is never touched) and their outputs are ignored (only each sequence's last row
is sampled). The real rows see exactly the keys they see eagerly: the attention aligns each
sequence's queries to its end (``seq_len`` stays the sequence's length), and a padding row
only reads keys that were in the pool before the step.

Why in front, and not padding rows after the real ones: rows after them would sit at positions
past the sequence, whose slots hold nothing written (stale values of another sequence, or
blocks the sequence does not own), and the real rows of their attention tile would multiply
those by zero weights; rows in front read only keys the draft computed. It needs
``len(tokens) >= Q``: a sequence shorter than the width (a short prompt's first catch-ups)
runs eagerly, as before.

Why 16, 32, 64 and 128: they are the W4A16 GEMM's row tiles (``w4a16_triton.plan``: 2-16, 17-32,
33-64 and 65-128 rows are one M tile of 16, 32, 64 and 128 rows, with the same split of K). At
batch 1 a catch-up of ``T`` tokens therefore runs in the tile plan its eager step ran, and the
tile's rows past ``T`` were computed (masked) anyway: the padding costs the GEMM nothing and
changes no real row's sums. The row-wise kernels (norms, rotary, SiLU) and the attention (a
64-row query tile, key tiles from position 0; the extra key tiles a shifted query tile walks are
masked for the real rows and add exact zeros) compute a row alike whatever shares its step.
With several sequences in a step the rows' count moves from ``sum T_i`` to ``n * Q`` and may
cross a GEMM tile bucket; the eager path's rows already depend on their step's total the same
way (a proposal only: the target verifies every token).

Catch-ups are at most 65 tokens with the speculator's back-off (1 + up to 64 skipped steps);
longer ones (a sequence that did not speculate for a while) and the first call on a prompt run
eagerly. The prompt's first call does not fit this design (nothing computed to recompute in
front) and needs it least: 513 tokens are a compute-bound step on the H200 (41-47 ms, about the
GPU time of its GEMMs), so its launches are hidden behind the device already.

Capture cost, logged once when the draft is built: 4 widths more at each batch size within
:data:`CATCH_UP_GRAPH_TOKENS` rows (for ``--speculate-max-batch-size 32``: sizes 1..32 at width
16, 1..16 at 32, 1..8 at 64, 1..4 at 128: 18 graphs besides the 12 decode ones), and a graph
pool sized by the largest, 512 rows of activations (llama-8b: gate_up's output alone is 29 MB;
predicted 0.1 GB in all, 2-4 s of capture on the H200: 3 eager forwards a graph).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Query lengths captured for catch-ups, beside the decode graphs' 1 and 2 (see above: the W4A16
# GEMM's row tiles).
CATCH_UP_WIDTHS = (16, 32, 64, 128)
# No catch-up graph of more rows: a step's GPU time grows with its rows once its GEMMs are
# compute-bound, and by about 300 rows (int4 llama-8b on the H200: 3.4 ms at 1 row, 41-47 ms at
# 513) it passes the 25 ms the host takes to launch an eager step, which it then hides; the
# graph pool grows with the rows. (From 129 rows an int4 layer takes its dequantize-then-cuBLAS
# path, DENSE_FROM_TOKENS.)
CATCH_UP_GRAPH_TOKENS = 512


@dataclass(frozen=True)
class CatchUpGraphs:
    """Which uniform widths the draft's graphs serve: ``widths`` ascending (its captured query
    lengths), ``graph_size(n, q)`` the captured batch size serving ``n`` sequences of ``q``
    rows, or None."""

    widths: tuple[int, ...]
    graph_size: Callable[[int, int], int | None]

    def width(self, new_tokens: Sequence[int], lengths: Sequence[int]) -> int | None:
        """The width a step of sequences with ``new_tokens[i]`` tokens to compute, ``lengths[i]``
        tokens in all, is laid out at (every sequence starts ``width - new_tokens[i]``
        positions early), or None: run it as it is (eagerly, unless it is uniform at a captured
        width already)."""
        longest, shortest = max(new_tokens), min(lengths)
        for q in self.widths:
            if q < longest:
                continue
            if q > shortest:  # some sequence has too few tokens to fill this width (or any wider)
                return None
            if self.graph_size(len(new_tokens), q) is not None:
                return q
        return None


def step_rows(tokens: Sequence[int], computed: int, width: int | None, blocks: Sequence[int],
              block_size: int) -> tuple[list[int], list[int], list[int]]:
    """One sequence's rows of a draft step: ids, positions and KV slots of ``tokens[computed:]``,
    preceded, when ``width`` is given, by the ``width - (len(tokens) - computed)`` tokens before
    them (recomputed, slot -1: never written). ``blocks`` is the sequence's block table."""
    end = len(tokens)
    first = computed if width is None else end - width
    if not 0 <= first <= computed:
        raise ValueError(f"width {width} does not fit a sequence of {end} tokens with {computed} computed")
    slots = [-1] * (computed - first) + [blocks[p // block_size] * block_size + p % block_size
                                         for p in range(computed, end)]
    return list(tokens[first:end]), list(range(first, end)), slots
