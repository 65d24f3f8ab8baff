"""The sampler: logits processors and token choice for a whole heterogeneous batch at once.

Each row carries its own parameters as tensors; a processor runs only when some row enables it,
and rows that disable it are left bit-identical. Order (as TGI, plus min_p last): repetition,
frequency and presence penalties; then, for sampled rows only, temperature, then the filters
top_k, top_p, typical_p, min_p. Greedy rows take the argmax after the penalties (as transformers
does).

Two distributions come out of a row. Tokens are drawn from the *filtered* one; the logprobs
reported (the chosen token's, the top-n alternatives', and so the sum best_of ranks by) are those
of the distribution after penalties and temperature but *before* filtering, as the proto
promises. Alternatives are still only tokens the filters kept: the others come back with a -inf
logprob, which the runner drops.

Sampled rows draw with the exponential-race (Gumbel-max) trick from *counter-based* noise: the
uniform for (seed, output position, token id) is a fixed hash, so a seeded request picks the
same tokens whatever it is batched with, after a preemption and across restarts, with no
per-row generator objects and no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sequence import Sequence
from .staging import Stager

_MASK53 = (1 << 53) - 1
_BELOW_ONE = 1.0 - 2.0**-24  # the largest float32 below 1


def _i64(x: int) -> int:
    """A 64-bit constant as a signed int64 (torch integer arithmetic wraps)."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = _i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)


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


@dataclass
class SamplingBatch:
    """Per-row parameters as tensors on the logits' device. N rows."""

    do_sample: torch.Tensor  # [N] bool
    temperature: torch.Tensor  # [N, 1]
    top_k: torch.Tensor  # [N, 1] int64, vocab size when off
    top_p: torch.Tensor  # [N, 1]
    typical_p: torch.Tensor  # [N, 1]
    min_p: torch.Tensor  # [N, 1]
    seeds: torch.Tensor  # [N] int64
    steps: torch.Tensor  # [N] int64: output position being sampled
    repetition_penalty: torch.Tensor | None  # [N, 1], None when no row uses it
    frequency_penalty: torch.Tensor | None  # [N, 1]
    presence_penalty: torch.Tensor | None  # [N, 1]
    seen_mask: torch.Tensor | None  # [N, V] bool: token appears in prompt or output
    output_counts: torch.Tensor | None  # [N, V] float: occurrences in the output
    suppress_mask: torch.Tensor | None  # [N, V] bool: EOS / stop ids banned before min_new_tokens
    any_sample: bool
    use_top_k: bool
    use_top_p: bool
    use_typical: bool
    use_min_p: bool
    max_top_n: int

    @property
    def use_filters(self) -> bool:
        """Whether some sampled row filters its distribution (top_k, top_p, typical_p, min_p)."""
        return self.use_top_k or self.use_top_p or self.use_typical or self.use_min_p


_SAMPLE, _TOP_K, _TOP_P, _TYPICAL, _MIN_P, _REP, _FREQ = (1 << i for i in range(7))


def _row_params(seq: Sequence, vocab_size: int) -> tuple[tuple[float, ...], tuple[int, int], int]:
    """A sequence's fixed sampler parameters, computed once per sequence: the float columns
    (temperature, top_p, typical_p, min_p, do_sample, repetition, frequency and presence
    penalties), (top_k, seed) and a bit set of the processors it enables."""
    cached = seq.sampler_row
    if cached is not None:
        return cached
    p, on = seq.sampling, seq.sampling.do_sample
    # Greedy rows keep every warper off so their logprobs are the penalised distribution's.
    top_k = p.top_k if on and 0 < p.top_k < vocab_size else vocab_size
    floats = (p.temperature if on else 1.0, p.top_p if on else 1.0, p.typical_p if on else 1.0,
              p.min_p if on else 0.0, 1.0 if on else 0.0,
              p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
    flags = ((_SAMPLE if on else 0) | (_TOP_K if top_k < vocab_size else 0) | (_TOP_P if floats[1] < 1.0 else 0)
             | (_TYPICAL if floats[2] < 1.0 else 0) | (_MIN_P if floats[3] > 0.0 else 0)
             | (_REP if p.repetition_penalty != 1.0 else 0)
             | (_FREQ if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 else 0))
    row = (floats, (top_k, _i64(seq.seed or 0)), flags)
    seq.sampler_row = row
    return row


def build_sampling_batch(seqs: list[Sequence], vocab_size: int, device: torch.device,
                         eos_token_ids: tuple[int, ...] = (), stager: Stager | None = None) -> SamplingBatch:
    """Per-row parameters on ``device``. With a ``stager`` the small per-row arrays go through
    pinned buffers without making the host wait (see :mod:`loom.engine.staging`)."""
    stage = stager or Stager(device)
    rows = [_row_params(s, vocab_size) for s in seqs]
    flags = 0
    for r in rows:
        flags |= r[2]
    # One transfer per dtype: float columns [N, 8], int64 columns [N, 3] (top_k, seed, step).
    n = len(seqs)  # 0 in a step of prefill chunks that complete no prompt
    floats = stage.to_device([r[0] for r in rows], torch.float32).view(n, 8)
    ints = stage.to_device([(*r[1], s.num_output_tokens) for r, s in zip(rows, seqs, strict=True)],
                           torch.int64).view(n, 3)
    use_rep, use_freq = bool(flags & _REP), bool(flags & _FREQ)
    seen_mask = output_counts = None
    if use_rep:
        seen_mask = torch.zeros(n, vocab_size + 1, dtype=torch.bool, device=device)
        ids = _padded([s.token_ids for s in seqs], vocab_size, device)
        seen_mask.scatter_(1, ids, True)
        seen_mask = seen_mask[:, :vocab_size]
    if use_freq:
        counts = torch.zeros(n, vocab_size + 1, dtype=torch.float32, device=device)
        ids = _padded([s.output_token_ids for s in seqs], vocab_size, device)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
        output_counts = counts[:, :vocab_size]
    suppress_mask = None
    young = [i for i, s in enumerate(seqs) if s.num_output_tokens < s.stopping.min_new_tokens]
    if young:
        mask = torch.zeros(n, vocab_size, dtype=torch.bool)
        for i in young:
            banned = [t for t in (*eos_token_ids, *seqs[i].stopping.stop_token_ids) if 0 <= t < vocab_size]
            mask[i, banned] = True
        suppress_mask = stage.to_device(mask, torch.bool)
    return SamplingBatch(
        do_sample=floats[:, 4] > 0.5,
        temperature=floats[:, 0:1],
        top_k=ints[:, 0:1],
        top_p=floats[:, 1:2],
        typical_p=floats[:, 2:3],
        min_p=floats[:, 3:4],
        seeds=ints[:, 1],
        steps=ints[:, 2],
        repetition_penalty=floats[:, 5:6] if use_rep else None,
        frequency_penalty=floats[:, 6:7] if use_freq else None,
        presence_penalty=floats[:, 7:8] if use_freq else None,
        seen_mask=seen_mask,
        output_counts=output_counts,
        suppress_mask=suppress_mask,
        any_sample=bool(flags & _SAMPLE),
        use_top_k=bool(flags & _TOP_K),
        use_top_p=bool(flags & _TOP_P),
        use_typical=bool(flags & _TYPICAL),
        use_min_p=bool(flags & _MIN_P),
        max_top_n=max((s.sampling.top_n_tokens for s in seqs), default=0),
    )


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0) or 1
    out = torch.full((len(rows), width), pad, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    return out.to(device)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor  # [N] float32: the chosen token's, after penalties and temperature, before filtering
    finite: torch.Tensor  # [N] bool: False where the processed logits held NaN or +inf (or all -inf)
    top_ids: torch.Tensor | None  # [N, max_top_n]: the most likely tokens the filters kept, best first ...
    top_logprobs: torch.Tensor | None  # [N, max_top_n]: ... on the same distribution; -inf: no such token


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    if b.suppress_mask is not None:
        logits = logits.masked_fill(b.suppress_mask, float("-inf"))
    if b.repetition_penalty is not None and b.seen_mask is not None:
        pen = b.repetition_penalty
        penalised = torch.where(logits < 0, logits * pen, logits / pen)
        logits = torch.where(b.seen_mask, penalised, logits)
    if b.output_counts is not None and b.frequency_penalty is not None and b.presence_penalty is not None:
        logits = logits - b.frequency_penalty * b.output_counts
        logits = logits - b.presence_penalty * (b.output_counts > 0).to(logits.dtype)
    return logits


def apply_temperature(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Each row divided by its temperature (greedy rows by 1.0, which is exact)."""
    return logits / b.temperature


def apply_filters(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """top_k, top_p, typical_p, min_p, each row with its own value (off = identity). A removed
    token's logit becomes the dtype's lowest finite value."""
    neg_inf = torch.finfo(logits.dtype).min
    if b.use_top_k:
        kth = torch.sort(logits, dim=-1, descending=True).values.gather(1, (b.top_k - 1).clamp(min=0))
        logits = logits.masked_fill(logits < kth, neg_inf)
    if b.use_top_p:
        sorted_logits, sorted_idx = torch.sort(logits, dim=-1)  # ascending
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove = cum <= (1 - b.top_p)
        remove[:, -1] = False  # always keep the most likely token
        remove &= b.top_p < 1.0
        logits = logits.masked_fill(remove.scatter(1, sorted_idx, remove), neg_inf)
    if b.use_typical:
        logp = logits.log_softmax(-1)
        ent = -(logp * logp.exp()).nansum(-1, keepdim=True)
        shifted = (-logp - ent).abs()
        sorted_scores, sorted_idx = torch.sort(shifted, dim=-1)
        cum = logits.gather(-1, sorted_idx).softmax(-1).cumsum(-1)
        last = (cum < b.typical_p).sum(dim=1, keepdim=True).clamp(max=logits.shape[-1] - 1)
        remove = sorted_scores > sorted_scores.gather(1, last)
        remove[:, 0] = False
        remove &= b.typical_p < 1.0
        logits = logits.masked_fill(remove.scatter(1, sorted_idx, remove), neg_inf)
    if b.use_min_p:
        probs = logits.softmax(-1)
        remove = probs < b.min_p * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(remove, neg_inf)
    return logits


def apply_warpers(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Temperature, then the filters: the distribution sampled rows draw from."""
    return apply_filters(apply_temperature(logits, b), b)


class Sampler:
    """Chooses one token per row. Works on float32 logits [N, V]."""

    def __call__(self, logits: torch.Tensor, b: SamplingBatch) -> SamplerOutput:
        # The distribution reported: after penalties and temperature, before filtering. [N, V]
        scaled = apply_penalties(logits.float(), b)
        if b.any_sample:
            scaled = apply_temperature(scaled, b)
        # The processed logits must be finite: a NaN or +inf anywhere in a row, from the model or
        # from a penalty or temperature that overflowed, makes the row's max NaN or +inf. One
        # reduction instead of isfinite(...).all() (five passes over [N, V], about 1 ms a step at
        # batch 512 on the H200). Filters only replace values by a finite lowest one, so they add
        # nothing to check. Rows never mix, so a bad row harms no other; its request fails on the
        # host. (A row of -inf also fails: nothing to choose.)
        finite = torch.isfinite(scaled.amax(dim=-1))
        filtering = b.any_sample and b.use_filters
        kept = torch.where(b.do_sample[:, None], apply_filters(scaled, b), scaled) if filtering else scaled
        logprobs = kept.log_softmax(-1)  # [N, V]: the distribution tokens are drawn from
        token_ids = logprobs.argmax(-1)
        if b.any_sample:
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
