"""The model runner: turns a scheduled step into one flattened forward and samples from it.

It owns the model, the attention backend and the KV pool. It lays out the step's tokens
(``input_ids`` and ``positions`` of every scheduled row, prefill and decode alike), the slots
their K/V go to and the block tables, sets the forward context the attention layers read, runs
the model once, computes logits only for the rows that are sampled (plus prompt rows whose
logprobs were asked for) and hands them to the sampler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from loom.layers.attention import AttentionBackend, AttentionMetadata, ForwardContext, forward_context

from .sampler import Sampler, build_sampling_batch, prompt_logprobs
from .scheduler import SchedulerOutput
from .sequence import Sequence

if TYPE_CHECKING:
    from .cuda_graphs import CudaGraphRunner


_PROMPT_LOGPROB_ROWS = 512


class CausalLM(Protocol):
    """What the runner needs of a model plugin's module (see plugins/models)."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...  # [T] -> [T, H]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # [N, H] -> [N, V] fp32


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_seqs: list[Sequence]  # rows that choose a token this step
    sample_rows: list[int]  # their row in the flat batch (forks reuse the parent's row)
    # prompt-logprob rows: (seq, first row, first position, count)
    prompt_rows: list[tuple[Sequence, int, int, int]] = field(default_factory=list)


@dataclass
class StepResult:
    seqs: list[Sequence]
    token_ids: list[int]
    logprobs: list[float]
    top_tokens: list[list[tuple[int, float]]] | None
    failed: dict[int, str]  # seq_id -> why its row could not be sampled (e.g. non-finite logits)


class ModelRunner:
    def __init__(self, model: CausalLM, backend: AttentionBackend, kv_caches: list[torch.Tensor],
                 block_size: int, vocab_size: int, device: torch.device,
                 eos_token_ids: tuple[int, ...] = (), fault_injection: bool = False,
                 cuda_graphs: CudaGraphRunner | None = None) -> None:
        self.model = model
        self.cuda_graphs = cuda_graphs  # replays pure-decode steps that fit a captured size
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.fault_injection = fault_injection  # tests only: see _inject_faults
        self.sampler = Sampler()

    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        sample_seqs: list[Sequence] = []
        sample_rows: list[int] = []
        prompt_rows: list[tuple[Sequence, int, int, int]] = []
        row_of: dict[int, int] = {}
        for seq, n in zip(sched.seqs, sched.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            end = start + n
            table = seq.block_table
            if n == 1:  # decode: the hot path at large batch, kept free of per-row tensor work
                ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                pos = torch.arange(start, end)
                slots.extend((torch.tensor(table)[pos // bs] * bs + pos % bs).tolist())
            if seq.sampling.prompt_logprobs and not seq.prompt_logprobs_sent and start < seq.num_prompt_tokens:
                # rows for positions start.. predict the next prompt token (the last prompt
                # position predicts the first output token: not a prompt logprob)
                count = min(end, seq.num_prompt_tokens - 1) - start
                prompt_rows.append((seq, query_start[-1], start, count))
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
            if end == seq.num_tokens:  # the whole context is computed: choose the next token
                sample_seqs.append(seq)
                sample_rows.append(query_start[-1] - 1)
                row_of[seq.seq_id] = query_start[-1] - 1
        for child, parent in sched.forks:
            sample_seqs.append(child)
            sample_rows.append(row_of[parent.seq_id])
        max_blocks = max(len(s.block_table) for s in sched.seqs)
        # one tensor from padded rows: a torch call per row costs more than the rows themselves
        tables = torch.tensor([s.block_table + [0] * (max_blocks - len(s.block_table)) for s in sched.seqs],
                              dtype=torch.int32)
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(query_start, dtype=torch.int32).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(dev),
            block_tables=tables.to(dev),
            query_lens_cpu=list(sched.num_new_tokens),
            seq_lens_cpu=seq_lens,
            max_query_len=max(sched.num_new_tokens),
            max_seq_len=max(seq_lens),
            block_size=bs,
        )
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64).to(dev),
            positions=torch.tensor(positions, dtype=torch.int64).to(dev),
            meta=meta,
            sample_seqs=sample_seqs,
            sample_rows=sample_rows,
            prompt_rows=prompt_rows,
        )

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks in every layer's pool."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for cache in self.kv_caches:  # [2, num_blocks, block_size, Hkv, D]
            cache[:, dst] = cache[:, src]

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        self.copy_blocks(sched.blocks_to_copy)
        inputs = self.prepare(sched)
        if self.fault_injection:
            _inject_faults(inputs)
        hidden = self.cuda_graphs.try_run(inputs) if self.cuda_graphs is not None else None
        if hidden is None:
            with forward_context(ForwardContext(self.backend, self.kv_caches, inputs.meta)):
                hidden = self.model(inputs.input_ids, inputs.positions)  # [T, hidden]
        rows = torch.tensor(inputs.sample_rows, dtype=torch.int64, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))  # [N, V] fp32
        if self.fault_injection:
            for i, seq in enumerate(inputs.sample_seqs):
                if seq.request_id.startswith("inject-nan"):
                    logits[i] = float("nan")
        finite = torch.isfinite(logits).all(dim=-1)  # [N]: a NaN row fails only its request
        logits = torch.where(finite[:, None], logits, torch.zeros_like(logits))
        batch = build_sampling_batch(inputs.sample_seqs, self.vocab_size, self.device, self.eos_token_ids)
        out = self.sampler(logits, batch)
        self._prompt_logprobs(hidden, inputs)
        top: list[list[tuple[int, float]]] | None = None
        if out.top_ids is not None and out.top_logprobs is not None:
            ids_l, lps_l = out.top_ids.tolist(), out.top_logprobs.tolist()
            top = [
                list(zip(i[: s.sampling.top_n_tokens], lp[: s.sampling.top_n_tokens], strict=True))
                for s, i, lp in zip(inputs.sample_seqs, ids_l, lps_l, strict=True)
            ]
        failed = {
            seq.seq_id: "the model produced non-finite logits (NaN or inf) for this request"
            for seq, ok in zip(inputs.sample_seqs, finite.tolist(), strict=True) if not ok
        }
        return StepResult(inputs.sample_seqs, out.token_ids.tolist(), out.logprobs.tolist(), top, failed)

    def _prompt_logprobs(self, hidden: torch.Tensor, inputs: StepInputs) -> None:
        """Accumulate prompt logprobs on the sequence, chunk by chunk (``seq.prompt_logprobs``)."""
        for seq, row, pos, count in inputs.prompt_rows:
            if pos == 0:
                seq.prompt_logprobs = [None]
            if count <= 0:
                continue
            # In slices: a [count, V] fp32 logits block for a long prompt would dominate memory.
            for lo in range(0, count, _PROMPT_LOGPROB_ROWS):
                hi = min(count, lo + _PROMPT_LOGPROB_ROWS)
                logits = self.model.compute_logits(hidden[row + lo : row + hi])  # [hi - lo, V]
                nxt = torch.tensor(seq.token_ids[pos + lo + 1 : pos + hi + 1], dtype=torch.int64,
                                   device=self.device)
                seq.prompt_logprobs.extend(prompt_logprobs(logits, nxt).tolist())


class InjectedFault(RuntimeError):
    """Raised on purpose (``--fault-injection``) to test failure isolation."""


def _inject_faults(inputs: StepInputs) -> None:
    for seq in inputs.sample_seqs:
        if seq.request_id.startswith("inject-fault"):
            raise InjectedFault(f"injected failure while running request {seq.request_id!r}")
