"""The sampler: logits processors and token choice for a whole heterogeneous batch at once.

Each row carries its own parameters as tensors; a processor runs only when some row enables it,
and rows that disable it are left bit-identical. Order (as TGI, plus min_p last): repetition,
frequency and presence penalties; then, for sampled rows only, temperature, top_k, top_p,
typical_p, min_p. Greedy rows take the argmax after the penalties (as transformers does).

Sampled rows draw with the exponential-race (Gumbel-max) trick from *counter-based* noise: the
uniform for (seed, output position, token id) is a fixed hash, so a seeded request picks the
same tokens whatever it is batched with, after a preemption and across restarts, with no
per-row generator objects and no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sequence import Sequence

_MASK53 = (1 << 53) - 1


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
    return ((_shr(x, 11) & _MASK53).to(torch.float64) + 0.5).mul_(2.0**-53).to(torch.float32)


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


def build_sampling_batch(seqs: list[Sequence], vocab_size: int, device: torch.device,
                         eos_token_ids: tuple[int, ...] = ()) -> SamplingBatch:
    sp = [s.sampling for s in seqs]
    samp = [p.do_sample for p in sp]

    def col(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

    # Greedy rows keep every warper off so their logprobs are the penalised distribution's.
    temperature = [p.temperature if s else 1.0 for p, s in zip(sp, samp, strict=True)]
    top_k = [p.top_k if s and 0 < p.top_k < vocab_size else vocab_size for p, s in zip(sp, samp, strict=True)]
    top_p = [p.top_p if s else 1.0 for p, s in zip(sp, samp, strict=True)]
    typical = [p.typical_p if s else 1.0 for p, s in zip(sp, samp, strict=True)]
    min_p = [p.min_p if s else 0.0 for p, s in zip(sp, samp, strict=True)]

    use_rep = any(p.repetition_penalty != 1.0 for p in sp)
    use_freq = any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in sp)
    seen_mask = output_counts = None
    if use_rep:
        seen_mask = torch.zeros(len(seqs), vocab_size + 1, dtype=torch.bool, device=device)
        ids = _padded([s.token_ids for s in seqs], vocab_size, device)
        seen_mask.scatter_(1, ids, True)
        seen_mask = seen_mask[:, :vocab_size]
    if use_freq:
        counts = torch.zeros(len(seqs), vocab_size + 1, dtype=torch.float32, device=device)
        ids = _padded([s.output_token_ids for s in seqs], vocab_size, device)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
        output_counts = counts[:, :vocab_size]
    suppress_mask = None
    young = [i for i, s in enumerate(seqs) if s.num_output_tokens < s.stopping.min_new_tokens]
    if young:
        suppress_mask = torch.zeros(len(seqs), vocab_size, dtype=torch.bool)
        for i in young:
            banned = [t for t in (*eos_token_ids, *seqs[i].stopping.stop_token_ids) if 0 <= t < vocab_size]
            suppress_mask[i, banned] = True
        suppress_mask = suppress_mask.to(device)
    return SamplingBatch(
        do_sample=torch.tensor(samp, dtype=torch.bool, device=device),
        temperature=col(temperature),
        top_k=torch.tensor(top_k, dtype=torch.int64, device=device).unsqueeze(1),
        top_p=col(top_p),
        typical_p=col(typical),
        min_p=col(min_p),
        seeds=torch.tensor([_i64(s.seed or 0) for s in seqs], dtype=torch.int64, device=device),
        steps=torch.tensor([s.num_output_tokens for s in seqs], dtype=torch.int64, device=device),
        repetition_penalty=col([p.repetition_penalty for p in sp]) if use_rep else None,
        frequency_penalty=col([p.frequency_penalty for p in sp]) if use_freq else None,
        presence_penalty=col([p.presence_penalty for p in sp]) if use_freq else None,
        seen_mask=seen_mask,
        output_counts=output_counts,
        suppress_mask=suppress_mask,
        any_sample=any(samp),
        use_top_k=any(k < vocab_size for k in top_k),
        use_top_p=any(p < 1.0 for p in top_p),
        use_typical=any(p < 1.0 for p in typical),
        use_min_p=any(p > 0.0 for p in min_p),
        max_top_n=max((p.top_n_tokens for p in sp), default=0),
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
    logprobs: torch.Tensor  # [N] float32: log-probability of the chosen token
    top_ids: torch.Tensor | None  # [N, max_top_n]
    top_logprobs: torch.Tensor | None  # [N, max_top_n]


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


def apply_warpers(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Temperature, top_k, top_p, typical_p, min_p, each row with its own value (off = identity)."""
    neg_inf = torch.finfo(logits.dtype).min
    logits = logits / b.temperature
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


class Sampler:
    """Chooses one token per row. Works on float32 logits [N, V]."""

    def __call__(self, logits: torch.Tensor, b: SamplingBatch) -> SamplerOutput:
        logits = apply_penalties(logits.float(), b)
        if b.any_sample:
            warped = apply_warpers(logits, b)
            logits = torch.where(b.do_sample[:, None], warped, logits)
        logprobs = logits.log_softmax(-1)  # [N, V]
        token_ids = logprobs.argmax(-1)
        if b.any_sample:
            u = counter_uniform(b.seeds, b.steps, logits.shape[-1])
            gumbel = -torch.log(-torch.log(u))  # [N, V]
            sampled = (logprobs + gumbel).argmax(-1)
            token_ids = torch.where(b.do_sample, sampled, token_ids)
        chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
        top_ids = top_lp = None
        if b.max_top_n > 0:
            top_lp, top_ids = logprobs.topk(b.max_top_n, dim=-1)
        return SamplerOutput(token_ids, chosen, top_ids, top_lp)


def prompt_logprobs(logits: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """log p(next_ids[i] | prefix up to row i) for rows of one prompt: [P-1, V] -> [P-1]."""
    return logits.float().log_softmax(-1).gather(1, next_ids[:, None]).squeeze(1)
