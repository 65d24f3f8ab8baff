"""What crosses the engine core / worker boundary: a step plan in, sampled tokens out.

The engine core (scheduler, block manager, sequences) turns a scheduled step into a
:class:`StepPlan`: flat lists of numbers and strings, no ``Sequence`` and no tensor, so the plan
survives pickling and a worker in another process (one per tensor-parallel rank) can run it. The
worker stages the plan on its device, runs the forward and the sampler, and answers with a
:class:`StepOutput`: for every sequence that chose tokens, the list of tokens it chose (one per
step, or up to m + 1 when m drafts are verified) with their logprobs. Only the engine core's output
processor changes sequences with them.

Shapes below: ``T`` tokens in the step (all rows, prefill and decode), ``B`` scheduled
sequences, ``N`` sequences that choose a token this step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loom.sample.batch import SamplingPlan

PENDING_INPUT = -1  # an input token still on the device (sampled by the step before, not read back)


@dataclass(slots=True)
class PromptLogprobRows:
    """Rows of one sequence whose logits score the prompt's next tokens (prompt logprobs)."""

    seq_id: int
    first_row: int  # in the flat batch
    first_position: int  # the position of that row: 0 starts the sequence's list with None
    next_token_ids: list[int]  # the prompt tokens these rows predict; len = number of rows scored


@dataclass(slots=True)
class StepPlan:
    """One step as a worker runs it. Lists hold plain ints (block tables are the engine's lists:
    in-process they are not copied, across a process boundary pickling copies them)."""

    input_ids: list[int]  # [T]; PENDING_INPUT where pending_rows says where to take it from
    positions: list[int]  # [T]
    slot_mapping: list[int]  # [T] flat KV slot (block * block_size + offset) each row writes
    query_lens: list[int]  # [B] rows of each scheduled sequence
    seq_lens: list[int]  # [B] context length of each sequence once this step is computed
    block_tables: list[list[int]]  # [B] each sequence's KV blocks
    pending_rows: list[int]  # flat rows whose input is a token the previous step sampled ...
    pending_src: list[int]  # ... at this index of that step's sampled ids
    # [R] rows whose logits choose a token: one per sampled sequence, or 1 + m consecutive rows
    # for a sequence verifying m drafts (R = N + sum of num_drafts)
    sample_rows: list[int]
    sample_seq_ids: list[int]  # [N]
    sample_request_ids: list[str]  # [N] for logs (and the test-only fault injector)
    sampling: SamplingPlan  # [R] rows of sampling parameters
    prompt_logprobs: list[PromptLogprobRows] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    num_drafts: list[int] | None = None  # [N] drafts each sampled sequence verifies (None: none)
    draft_token_ids: list[int] = field(default_factory=list)  # [sum of num_drafts] in order
    # LoRA: each scheduled sequence's adapter slot (aligned with query_lens: its rows are one
    # segment), 0 = the base model; None when no row of the step uses an adapter
    lora_slots: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass(slots=True)
class StepOutput:
    """What a step chose, per sampled sequence, in the plan's ``sample_seq_ids`` order."""

    seq_ids: list[int]  # [N]
    token_ids: list[list[int]]  # [N][k] accepted tokens of each sequence, in order (k >= 1)
    logprobs: list[list[float]]  # [N][k]
    top_tokens: list[list[list[tuple[int, float]]]] | None  # [N][k][<= top_n] (id, logprob), or None
    failed: dict[int, str]  # seq_id -> why its row could not be sampled (e.g. non-finite logits)
    prompt_logprobs: dict[int, list[float]] = field(default_factory=dict)  # seq_id -> this step's rows
