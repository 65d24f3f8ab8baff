"""The sampler: applies the step's logits processors and chooses one token per row, for a whole
heterogeneous batch at once.

Each row carries its own parameters as tensors; a processor runs only when some row enables it,
and rows that disable it are left bit-identical. Order (as TGI, plus min_p last): suppression,
repetition, frequency and presence penalties, then, when some row samples, temperature (the
batch's ``processors``); then, for sampled rows only, the filters top_k, top_p, typical_p, min_p
(the batch's ``filters``). Greedy rows take the argmax after the penalties (as transformers does).

Two distributions come out of a row. Tokens are drawn from the *filtered* one; the logprobs
reported (the chosen token's, the top-n alternatives', and so the sum best_of ranks by) are those
of the distribution after the processors but *before* filtering, as the proto promises.
Alternatives are still only tokens the filters kept: the others come back with a -inf logprob,
which the runner drops.

Sampled rows draw with the exponential-race (Gumbel-max) trick from counter-based noise
(:mod:`loom.sample.noise`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import greedy_triton
from .batch import SamplingBatch
from .noise import counter_uniform
from .processors import apply_processors


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor  # [N] float32: the chosen token's, after the processors, before filtering
    finite: torch.Tensor  # [N] bool: False where the processed logits held NaN or +inf (or all -inf)
    top_ids: torch.Tensor | None  # [N, max_top_n]: the most likely tokens the filters kept, best first ...
    top_logprobs: torch.Tensor | None  # [N, max_top_n]: ... on the same distribution; -inf: no such token


class Sampler:
    """Chooses one token per row. Works on float32 logits [N, V]."""

    def __call__(self, logits: torch.Tensor, b: SamplingBatch) -> SamplerOutput:
        # The distribution reported: after the processors, before filtering. [N, V]
        scaled = apply_processors(logits.float(), b.processors)
        if not b.any_sample and b.max_top_n == 0 and greedy_triton.serves(scaled):
            # Every row greedy, no alternatives: one launch (the same tokens as below).
            token_ids, chosen, finite = greedy_triton.greedy_pick(scaled)
            return SamplerOutput(token_ids, chosen, finite, None, None)
        # The processed logits must be finite: a NaN or +inf anywhere in a row, from the model or
        # from a penalty or temperature that overflowed, makes the row's max NaN or +inf. One
        # reduction instead of isfinite(...).all() (five passes over [N, V], about 1 ms a step at
        # batch 512 on the H200). Filters only replace values by a finite lowest one, so they add
        # nothing to check. Rows never mix, so a bad row harms no other; its request fails on the
        # host. (A row of -inf also fails: nothing to choose.)
        finite = torch.isfinite(scaled.amax(dim=-1))
        filtering = b.any_sample and bool(b.filters)
        kept = scaled
        if filtering:
            assert b.do_sample is not None  # present whenever a row samples
            kept = torch.where(b.do_sample[:, None], apply_processors(scaled, b.filters), scaled)
        logprobs = kept.log_softmax(-1)  # [N, V]: the distribution tokens are drawn from
        # Greedy rows (``kept`` is ``scaled`` there): the first maximal processed logit, as
        # transformers picks it (log_softmax's rounding could tie two logits one ulp apart).
        token_ids = kept.argmax(-1)
        if b.any_sample:
            assert b.do_sample is not None and b.seeds is not None and b.steps is not None
            u = counter_uniform(b.seeds, b.steps, logits.shape[-1])
            gumbel = -torch.log(-torch.log(u))  # [N, V]
            sampled = (logprobs + gumbel).argmax(-1)
            token_ids = torch.where(b.do_sample, sampled, token_ids)
        # Without a filter the two distributions are one; with one, a second log_softmax (rows
        # that filter nothing get the same values as ``logprobs``).
        reported = scaled.log_softmax(-1) if filtering else logprobs  # [N, V]
        chosen = reported.gather(1, token_ids[:, None]).squeeze(1)
        top_ids = top_lp = None
        if b.max_top_n > 0:
            # Ranked on the filtered distribution, whose kept tokens are in the same order as in
            # the reported one and ahead of every removed token; a removed token (or one of zero
            # probability) that still makes the top n is marked -inf, for the host to drop.
            top_ids = logprobs.topk(b.max_top_n, dim=-1).indices  # [N, max_top_n]
            removed = kept.gather(1, top_ids) <= torch.finfo(kept.dtype).min
            top_lp = reported.gather(1, top_ids).masked_fill(removed, float("-inf"))
        return SamplerOutput(token_ids, chosen, finite, top_ids, top_lp)


def prompt_logprobs(logits: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """log p(next_ids[i] | prefix up to row i) for rows of one prompt: [P-1, V] -> [P-1]."""
    return logits.float().log_softmax(-1).gather(1, next_ids[:, None]).squeeze(1)
