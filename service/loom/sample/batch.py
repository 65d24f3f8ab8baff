"""The step's sampling tensors, built from the sequences that choose a token, and the processors
some row of the step needs (see :mod:`loom.sample.processors`)."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

import torch

from loom.engine.sequence import Sequence
from loom.engine.staging import Stager

from .noise import i64
from .processors import (
    FrequencyPresencePenalty,
    LogitsProcessor,
    MinP,
    RepetitionPenalty,
    Suppression,
    Temperature,
    TokenBitmask,
    TopK,
    TopP,
    TypicalP,
)


@dataclass
class SamplingBatch:
    """One step's sampling inputs on the logits' device. N rows."""

    do_sample: torch.Tensor  # [N] bool
    seeds: torch.Tensor  # [N] int64
    steps: torch.Tensor  # [N] int64: output position being sampled
    any_sample: bool
    max_top_n: int
    # Shape the reported distribution (penalties, suppression, temperature), in order.
    processors: list[LogitsProcessor] = field(default_factory=list)
    # Narrow what sampled rows draw from (top_k, top_p, typical_p, min_p), in order.
    filters: list[LogitsProcessor] = field(default_factory=list)


class TokenBitmaskSource(Protocol):
    """Where a step's grammar bitmask comes from (loom.structured.driver.StructuredOutput)."""

    def token_bitmask(self, seqs: Seq[Sequence], stager: Stager) -> TokenBitmask | None: ...


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
    row = (floats, (top_k, i64(seq.seed or 0)), flags)
    seq.sampler_row = row
    return row


def build_sampling_batch(seqs: list[Sequence], vocab_size: int, device: torch.device,
                         eos_token_ids: tuple[int, ...] = (), stager: Stager | None = None,
                         token_bitmask: TokenBitmask | None = None) -> SamplingBatch:
    """Per-row parameters on ``device`` and the processors some row enables. With a ``stager``
    the small per-row arrays go through pinned buffers without making the host wait (see
    :mod:`loom.engine.staging`). ``token_bitmask``: the grammar rows of this step (structured
    output), first of the processors; those rows' min_new_tokens is already in their mask."""
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
    processors: list[LogitsProcessor] = [token_bitmask] if token_bitmask is not None else []
    # EOS / stop ids of rows before their min_new_tokens, as flat indices row * V + token.
    banned = [i * vocab_size + t for i, s in enumerate(seqs)
              if s.num_output_tokens < s.stopping.min_new_tokens and s.sampling.constraint is None
              for t in (*eos_token_ids, *s.stopping.stop_token_ids) if 0 <= t < vocab_size]
    if banned:
        processors.append(Suppression(stage.to_device(banned, torch.int64)))
    if flags & _REP:
        seen = torch.zeros(n, vocab_size + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, _padded([s.token_ids for s in seqs], vocab_size, device), True)
        processors.append(RepetitionPenalty(floats[:, 5:6], seen[:, :vocab_size]))
    if flags & _FREQ:
        counts = torch.zeros(n, vocab_size + 1, dtype=torch.float32, device=device)
        ids = _padded([s.output_token_ids for s in seqs], vocab_size, device)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
        processors.append(FrequencyPresencePenalty(floats[:, 6:7], floats[:, 7:8], counts[:, :vocab_size]))
    filters: list[LogitsProcessor] = []
    if flags & _SAMPLE:
        processors.append(Temperature(floats[:, 0:1]))
        if flags & _TOP_K:
            filters.append(TopK(ints[:, 0:1]))
        if flags & _TOP_P:
            filters.append(TopP(floats[:, 1:2]))
        if flags & _TYPICAL:
            filters.append(TypicalP(floats[:, 2:3]))
        if flags & _MIN_P:
            filters.append(MinP(floats[:, 3:4]))
    return SamplingBatch(
        do_sample=floats[:, 4] > 0.5,
        seeds=ints[:, 1],
        steps=ints[:, 2],
        any_sample=bool(flags & _SAMPLE),
        max_top_n=max((s.sampling.top_n_tokens for s in seqs), default=0),
        processors=processors,
        filters=filters,
    )


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0) or 1
    out = torch.full((len(rows), width), pad, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    return out.to(device)
