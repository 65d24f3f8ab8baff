"""A sequence: one completion being generated, with its tokens, KV blocks and status."""

from __future__ import annotations

import enum
import itertools

from .types import EngineRequest, FinishReason, SamplingParams, StoppingParams

_seq_ids = itertools.count()

PENDING_TOKEN = -1  # a sampled token not yet read back from the device


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV blocks, decoded every step
    FINISHED = "finished"


class Sequence:
    """Tokens so far (prompt then output), how many of them have KV in the pool, and the blocks.

    The tokens still to compute in the next forward are ``token_ids[num_computed_tokens:]``:
    the whole prompt for a new sequence, the last sampled token while decoding, everything after
    a preemption (recompute).

    With asynchronous scheduling the last ``num_pending_tokens`` entries of ``token_ids`` are
    placeholders (``PENDING_TOKEN``): tokens a launched step samples on the device and the host
    has not read back yet. The next step already takes them as input, from the device.
    """

    def __init__(self, request: EngineRequest, index: int, seed: int | None) -> None:
        self.seq_id = next(_seq_ids)
        self.request_id = request.request_id
        self.index = index
        self.sampling: SamplingParams = request.sampling
        self.stopping: StoppingParams = request.stopping
        self.priority = request.priority
        self.arrival_time = request.arrival_time
        self.seed = seed
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens whose KV came from the prefix cache
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of this sequence's full, computed blocks
        # LoRA: the adapter's unique key (its name and load number: a name unloaded and loaded
        # again from other files is another adapter), part of every block hash, so adapters
        # never share KV; and its slot on the device (0: the base model)
        self.adapter_id = ""
        self.lora_slot = 0
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.cumulative_logprob = 0.0
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None  # monotonic: when a step first ran it (prefill began)
        self.prompt_logprobs_sent = False
        self.prompt_logprobs: list[float | None] = []  # accumulated over prefill chunks
        self.num_pending_tokens = 0  # trailing placeholders (see the class docstring)
        self.pending_row = -1  # row of the newest placeholder in the last launched step's samples
        self.uses_pending_blocks = False  # started on prefix blocks the current step is still filling
        self.max_model_len: int | None = None  # the engine's limit: stop scheduling past it
        # the sampler's per-row constants, computed on first use (see loom.engine.step_planner._row_params)
        self.sampler_row: tuple[tuple[float, ...], tuple[int, int], int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_known_tokens(self) -> int:
        return len(self.token_ids) - self.num_pending_tokens

    @property
    def length_exhausted(self) -> bool:
        """Its tokens (placeholders included) already reach max_new_tokens or the model's length:
        the step that sampled the last one will finish it, so it needs no further step."""
        if self.num_output_tokens >= self.stopping.max_new_tokens:
            return True
        return self.max_model_len is not None and self.num_tokens >= self.max_model_len

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}/{self.index}, {self.status.value}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, blocks={self.block_table})"
        )
