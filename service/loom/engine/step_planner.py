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


def _extend_slots(slots: list[int], table: list[int], start: int, end: int, bs: int) -> None:
    """Append the KV slots of positions ``start..end-1`` (slot = ``table[p // bs] * bs + p % bs``)
    a block at a time: one ``range`` a block instead of a Python step a token (a 16,384-token
    prefill step's slots in 0.6 ms instead of 1.25 on this project's VM)."""
    p = start
    while p < end:
        b = p // bs
        stop = min(end, (b + 1) * bs)
        offset = (table[b] - b) * bs  # slot - position inside block b
        slots.extend(range(offset + p, offset + stop))
        p = stop


def plan_step(sched: SchedulerOutput, block_size: int, vocab_size: int, eos_token_ids: tuple[int, ...],
              drafts: dict[int, list[int]] | None = None) -> PlannedStep:
    """``drafts``: seq_id -> draft tokens to verify after its last token (the scheduler gave such
    a sequence 1 + len(drafts) rows: its last token, then the drafts as inputs)."""
    bs = block_size
    drafts = drafts or {}
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
        guess = drafts.get(seq.seq_id) if drafts else None
        if guess is not None:  # verification: the last token, then the drafts, all as inputs
            assert n == 1 + len(guess) and start == seq.num_tokens - 1, seq
            ids.append(seq.token_ids[start])
            ids.extend(guess)
            positions.extend(range(start, end))
            _extend_slots(slots, table, start, end, bs)
            num_rows += n
            seq_lens.append(end)
            sample_seqs.append(seq)
            sample_rows.extend(range(num_rows - n, num_rows))  # row j scores the token after input j
            continue
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
            _extend_slots(slots, table, start, end, bs)
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
    seq_drafts = [drafts.get(s.seq_id, []) for s in sample_seqs] if drafts else None
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
        sampling=sampling_plan(sample_seqs, vocab_size, eos_token_ids, seq_drafts),
        prompt_logprobs=prompt_rows,
        blocks_to_copy=list(sched.blocks_to_copy),
        num_drafts=[len(d) for d in seq_drafts] if seq_drafts is not None else None,
        draft_token_ids=[t for d in seq_drafts for t in d] if seq_drafts is not None else [],
        lora_slots=_lora_slots(sched.seqs),
    )
    return PlannedStep(plan, sample_seqs, prompt_seqs)


def _lora_slots(seqs: list[Sequence]) -> list[int] | None:
    """Each sequence's adapter slot (its rows are one segment of the step), or None: no adapter."""
    slots = [s.lora_slot for s in seqs]
    return slots if any(slots) else None


def sampling_plan(seqs: list[Sequence], vocab_size: int, eos_token_ids: tuple[int, ...] = (),
                  drafts: list[list[int]] | None = None) -> SamplingPlan:
    """The sampling rows of ``seqs``, in order. A sequence verifying drafts ``d`` has 1 + len(d)
    rows: row j samples its output position num_output + j as if d[:j] were already its output
    (its seed, step, min_new_tokens and penalty history are those of that position)."""
    if drafts is not None and any(drafts):
        return _sampling_plan_with_drafts(seqs, vocab_size, eos_token_ids, drafts)
    rows = [_row_params(s, vocab_size) for s in seqs]
    flags = 0
    for r in rows:
        flags |= r[2]
    # EOS / stop ids of rows before their min_new_tokens, as flat indices row * V + token (a
    # grammar's row has them in its mask instead: loom.structured.driver).
    banned = [i * vocab_size + t for i, s in enumerate(seqs)
              if s.num_output_tokens < s.stopping.min_new_tokens and s.sampling.constraint is None
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


def _sampling_plan_with_drafts(seqs: list[Sequence], vocab_size: int, eos_token_ids: tuple[int, ...],
                               drafts: list[list[int]]) -> SamplingPlan:
    floats: list[tuple[float, ...]] = []
    ints: list[tuple[int, int, int]] = []
    banned: list[int] = []
    top_n: list[int] = []
    seen: list[list[int]] = []
    outputs: list[list[int]] = []
    flags = 0
    for seq, guess in zip(seqs, drafts, strict=True):
        row = _row_params(seq, vocab_size)
        flags |= row[2]
        stop = (*eos_token_ids, *seq.stopping.stop_token_ids)
        for j in range(1 + len(guess)):
            step = seq.num_output_tokens + j
            if step < seq.stopping.min_new_tokens and seq.sampling.constraint is None:
                banned += [len(floats) * vocab_size + t for t in stop if 0 <= t < vocab_size]
            floats.append(row[0])
            ints.append((*row[1], step))
            top_n.append(seq.sampling.top_n_tokens)
            if row[2] & (REPETITION | FREQUENCY):
                seen.append(seq.token_ids + guess[:j])
                outputs.append(seq.output_token_ids + guess[:j])
            else:
                seen.append([])
                outputs.append([])
    return SamplingPlan(floats=floats, ints=ints, flags=flags, banned=banned, top_n=top_n,
                        seen_token_ids=seen if flags & REPETITION else None,
                        output_token_ids=outputs if flags & FREQUENCY else None)


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
