"""Scheduled sequences -> a step plan: the flat rows a worker runs (see ``loom.worker.step_plan``).

The planner reads the engine core's sequences and writes nothing on them: the engine commits a
step (computed tokens, placeholders for the tokens being sampled) once the worker has taken it.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.sample.batch import (
    FREQUENCY,
    MIN_P,
    REPETITION,
    SAMPLE,
    TOP_K,
    TOP_P,
    TYPICAL,
    SamplingPlan,
)
from loom.sample.noise import i64
from loom.worker.step_plan import PENDING_INPUT, PromptLogprobRows, StepPlan

from .scheduler import SchedulerOutput
from .sequence import Sequence

_RowParams = tuple[tuple[float, ...], tuple[int, int], int]


@dataclass(slots=True)
class PlannedStep:
    """A plan and the engine's view of it: the sequences behind the plan's sampled rows."""

    plan: StepPlan
    sample_seqs: list[Sequence]  # [N] aligned with plan.sample_seq_ids
    prompt_seqs: list[Sequence]  # the sequences of plan.prompt_logprobs, in order


def plan_step(sched: SchedulerOutput, block_size: int, vocab_size: int,
              eos_token_ids: tuple[int, ...]) -> PlannedStep:
    bs = block_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    sample_seqs: list[Sequence] = []
    sample_rows: list[int] = []
    prompt_rows: list[PromptLogprobRows] = []
    prompt_seqs: list[Sequence] = []
    pending_rows: list[int] = []  # flat rows whose input token is still on the device ...
    pending_src: list[int] = []  # ... at these rows of the previous step's sampled ids
    row_of: dict[int, int] = {}
    num_rows = 0
    for seq, n in zip(sched.seqs, sched.num_new_tokens, strict=True):
        start = seq.num_computed_tokens
        end = start + n
        table = seq.block_table
        if n == 1:  # decode: the hot path at large batch, kept free of per-row work
            if start >= seq.num_known_tokens:
                assert start == seq.num_tokens - 1 and seq.pending_row >= 0, seq
                pending_rows.append(num_rows)
                pending_src.append(seq.pending_row)
                ids.append(PENDING_INPUT)
            else:
                ids.append(seq.token_ids[start])
            positions.append(start)
            slots.append(table[start // bs] * bs + start % bs)
        else:
            assert end <= seq.num_known_tokens, seq  # a prefill's tokens are all known
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend([table[p // bs] * bs + p % bs for p in range(start, end)])
        if seq.sampling.prompt_logprobs and not seq.prompt_logprobs_sent and start < seq.num_prompt_tokens:
            # rows for positions start.. predict the next prompt token (the last prompt position
            # predicts the first output token: not a prompt logprob)
            count = max(0, min(end, seq.num_prompt_tokens - 1) - start)
            prompt_rows.append(PromptLogprobRows(seq.seq_id, num_rows, start,
                                                 seq.token_ids[start + 1 : start + count + 1]))
            prompt_seqs.append(seq)
        num_rows += n
        seq_lens.append(end)
        if end == seq.num_tokens:  # the whole context is computed: choose the next token
            sample_seqs.append(seq)
            sample_rows.append(num_rows - 1)
            row_of[seq.seq_id] = num_rows - 1
    for child, parent in sched.forks:
        sample_seqs.append(child)
        sample_rows.append(row_of[parent.seq_id])
    plan = StepPlan(
        input_ids=ids,
        positions=positions,
        slot_mapping=slots,
        query_lens=list(sched.num_new_tokens),
        seq_lens=seq_lens,
        block_tables=[s.block_table for s in sched.seqs],
        pending_rows=pending_rows,
        pending_src=pending_src,
        sample_rows=sample_rows,
        sample_seq_ids=[s.seq_id for s in sample_seqs],
        sample_request_ids=[s.request_id for s in sample_seqs],
        sampling=sampling_plan(sample_seqs, vocab_size, eos_token_ids),
        prompt_logprobs=prompt_rows,
        blocks_to_copy=list(sched.blocks_to_copy),
    )
    return PlannedStep(plan, sample_seqs, prompt_seqs)


def sampling_plan(seqs: list[Sequence], vocab_size: int, eos_token_ids: tuple[int, ...] = ()) -> SamplingPlan:
    """The sampling rows of ``seqs``, in order."""
    rows = [_row_params(s, vocab_size) for s in seqs]
    flags = 0
    for r in rows:
        flags |= r[2]
    # EOS / stop ids of rows before their min_new_tokens, as flat indices row * V + token.
    banned = [i * vocab_size + t for i, s in enumerate(seqs) if s.num_output_tokens < s.stopping.min_new_tokens
              for t in (*eos_token_ids, *s.stopping.stop_token_ids) if 0 <= t < vocab_size]
    return SamplingPlan(
        floats=[r[0] for r in rows],
        ints=[(*r[1], s.num_output_tokens) for r, s in zip(rows, seqs, strict=True)],
        flags=flags,
        banned=banned,
        top_n=[s.sampling.top_n_tokens for s in seqs],
        seen_token_ids=[s.token_ids for s in seqs] if flags & REPETITION else None,
        output_token_ids=[s.output_token_ids for s in seqs] if flags & FREQUENCY else None,
    )


def _row_params(seq: Sequence, vocab_size: int) -> _RowParams:
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
    flags = ((SAMPLE if on else 0) | (TOP_K if top_k < vocab_size else 0) | (TOP_P if floats[1] < 1.0 else 0)
             | (TYPICAL if floats[2] < 1.0 else 0) | (MIN_P if floats[3] > 0.0 else 0)
             | (REPETITION if p.repetition_penalty != 1.0 else 0)
             | (FREQUENCY if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 else 0))
    row = (floats, (top_k, i64(seq.seed or 0)), flags)
    seq.sampler_row = row
    return row
