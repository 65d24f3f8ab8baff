"""The model runner: runs a step plan as one flattened forward and samples from it.

It holds the model, the attention backend and the KV pool (the worker builds them). It stages
the plan's flat rows (``input_ids`` and ``positions`` of every scheduled row, prefill and decode
alike, the slots their K/V go to, the block tables) on the device, sets the forward context the
attention layers read, runs the model once, computes logits only for the rows that are sampled
(plus prompt rows whose logprobs were asked for) and hands them to the sampler.
"""

from __future__ import annotations

import array
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from loom.layers.attention import AttentionBackend, AttentionMetadata, ForwardContext, forward_context
from loom.lora.layers import LoraBatch, LoraSlots, lora_batch
from loom.plugin_api.model import CausalLM
from loom.sample.batch import SamplingBatch, TokenBitmaskRows, build_sampling_batch, token_bitmask
from loom.sample.sampler import Sampler, prompt_logprobs
from loom.sample.verify import accepted_prefix

from .staging import DeviceToHost, Stager
from .step_plan import StepOutput, StepPlan

if TYPE_CHECKING:
    from .cuda_graphs import CudaGraphRunner


_PROMPT_LOGPROB_ROWS = 512
_NO_TOKEN = float("-inf")  # the sampler's top-n logprob of a slot that holds no kept token
_NON_FINITE = ("non-finite logits (NaN or inf) for this request, from the model or after its penalties and "
               "temperature")


@dataclass
class StepInputs:
    """A step's inputs on the device."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    plan: StepPlan | None = None  # what they were staged from (None: a test's hand-made step)
    lora: LoraBatch | None = None  # the rows' adapter slots (None: every row is the base model)
    sample_rows: torch.Tensor | None = None  # [N] int64: the plan's sample_rows, staged with the rest
    # ([P] rows of input_ids, [P] rows of the previous step's sampled ids): staged, not yet taken
    pending: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class ForwardedStep:
    """A step whose forward and logits are queued on the device, its sampling not yet
    (:meth:`ModelRunner.sample`)."""

    plan: StepPlan
    hidden: torch.Tensor  # [T, hidden] (prompt logprobs read it)
    logits: torch.Tensor  # [N, V] fp32
    batch: SamplingBatch


@dataclass
class StagedForward:
    """A step whose inputs are queued for the device and whose sampling batch is built, its
    forward not launched yet (:meth:`ModelRunner.launch_staged`). The engine stages a step before
    it waits for the grammar rows of the step before it, whose sampling must be queued first:
    this step's pending rows take that step's tokens, which :meth:`ModelRunner.launch_staged`
    gathers."""

    plan: StepPlan
    inputs: StepInputs
    batch: SamplingBatch


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued on the device; :meth:`ModelRunner.finish`
    reads the results back."""

    plan: StepPlan
    sampled_ids: torch.Tensor  # [N] int64 on the device: the next step's input for these rows
    host: list[torch.Tensor]  # token ids, logprobs, finite flags[, top ids, top logprobs] (host)
    transfer: DeviceToHost
    prompt_logprobs: dict[int, list[float]]  # seq_id -> logprobs of this step's prompt rows


class ModelRunner:
    """Runs step plans on one device: stages the plan, runs the forward (a CUDA graph when one
    fits), computes the logits of the rows that choose a token and samples them."""

    def __init__(self, model: CausalLM, backend: AttentionBackend, kv_caches: list[torch.Tensor],
                 block_size: int, vocab_size: int, device: torch.device,
                 cuda_graphs: CudaGraphRunner | None = None) -> None:
        self.model = model
        self.cuda_graphs = cuda_graphs  # replays steps of a captured size and query length
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.sampler = Sampler()
        self.stager = Stager(device)
        self.lora: LoraSlots | None = None  # the adapters' slot tables (the worker's; None: no LoRA)
        # The last launched step's sampled ids [N] (device): inputs for rows whose token the
        # host has not read back yet (StepPlan.pending_rows / pending_src index it).
        self.last_sampled: torch.Tensor | None = None

    def prepare(self, plan: StepPlan) -> StepInputs:
        """Stage the plan's arrays on the device (queued, not waited for)."""
        inputs = self._stage_inputs(plan)
        self._take_pending(inputs)
        return inputs

    def _stage_inputs(self, plan: StepPlan) -> StepInputs:
        """:meth:`prepare` but for the rows whose token the previous step samples on the device."""
        query_start = [0]
        for n in plan.query_lens:
            query_start.append(query_start[-1] + n)
        # Padded to a multiple of 16: Triton specialises integer arguments on divisibility by 16,
        # so a table stride that changed with the longest sequence would compile new kernel
        # variants in the middle of serving (a second or more each, seen on the H200).
        max_blocks = -(-max(len(t) for t in plan.block_tables) // 16) * 16
        stage = self.stager
        stage.next_step()
        # Two transfers, one per dtype (each array its own was a tensor, a pinned write and a
        # queued copy: nine of them a step, a visible share of a batch-1 step's host time).
        query_start_loc, seq_lens, tables = stage.to_device_many(
            [query_start, plan.seq_lens, _block_tables(plan.block_tables, max_blocks)], torch.int32)
        input_ids, positions, slots, sample_rows, pending_rows, pending_src = stage.to_device_many(
            [plan.input_ids, plan.positions, plan.slot_mapping, plan.sample_rows, plan.pending_rows,
             plan.pending_src], torch.int64)
        meta = AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            slot_mapping=slots,
            block_tables=tables.view(len(plan.block_tables), max_blocks),
            query_lens_cpu=plan.query_lens,
            seq_lens_cpu=plan.seq_lens,
            max_query_len=max(plan.query_lens),
            max_seq_len=max(plan.seq_lens),
            block_size=self.block_size,
        )
        return StepInputs(input_ids=input_ids, positions=positions, meta=meta, plan=plan, lora=self._lora_batch(plan),
                          sample_rows=sample_rows, pending=(pending_rows, pending_src) if plan.pending_rows else None)

    def _take_pending(self, inputs: StepInputs) -> None:
        """The previous step's sampled tokens into the rows that wait for them (queued after its
        sampling)."""
        if inputs.pending is not None:
            assert self.last_sampled is not None
            pending_rows, pending_src = inputs.pending
            inputs.input_ids.index_copy_(0, pending_rows, self.last_sampled.index_select(0, pending_src))
            inputs.pending = None

    def _lora_batch(self, plan: StepPlan) -> LoraBatch | None:
        """The step's row -> adapter slot map: each sequence's slot repeated over its rows (its
        segment); on the CPU also the rows of each adapter present, for the torch path."""
        if self.lora is None or plan.lora_slots is None:
            return None
        seg_slots = torch.tensor(plan.lora_slots, dtype=torch.int32)  # [B]
        token_slots = seg_slots.repeat_interleave(torch.tensor(plan.query_lens, dtype=torch.int64))  # [T]
        if self.lora.kernel is not None:
            return LoraBatch(token_slots.to(self.device, non_blocking=True), [], use_kernel=True)
        rows = [(int(s), (token_slots == s).nonzero().squeeze(1)) for s in seg_slots.unique().tolist() if s]
        return LoraBatch(token_slots, rows)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks in every layer's pool."""
        if not pairs:
            return
        src = self.stager.to_device([s for s, _ in pairs], torch.int64)
        dst = self.stager.to_device([d for _, d in pairs], torch.int64)
        for cache in self.kv_caches:  # [2, num_blocks, block_size, Hkv, D]
            cache[:, dst] = cache[:, src]

    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Queue the step's forward and sampling on the device; the host does not wait for them
        (except for prompt logprobs, which are read back at once)."""
        with torch.inference_mode():  # entered once for both halves
            return self._sample(self._launch_forward(plan), None)

    @torch.inference_mode()
    def launch_forward(self, plan: StepPlan) -> ForwardedStep:
        """Queue the step's forward and its logits; :meth:`sample` queues the sampling. Between
        the two the host may do work that needs the previous step's tokens (structured output
        fills its masks there) while the device runs the forward."""
        return self._launch_forward(plan)

    @torch.inference_mode()
    def stage_forward(self, plan: StepPlan) -> StagedForward:
        """Queue the step's inputs and build its sampling batch; :meth:`launch_staged` launches
        its forward, after the previous step's sampling was queued."""
        inputs = self._stage_inputs(plan)
        batch = build_sampling_batch(plan.sampling, self.vocab_size, self.device, self.stager)
        return StagedForward(plan, inputs, batch)

    @torch.inference_mode()
    def launch_staged(self, staged: StagedForward) -> ForwardedStep:
        """:meth:`launch_forward` of a step :meth:`stage_forward` staged."""
        self._take_pending(staged.inputs)
        hidden, logits = self._forward_logits(staged.inputs)
        return ForwardedStep(staged.plan, hidden, logits, staged.batch)

    def _launch_forward(self, plan: StepPlan) -> ForwardedStep:
        hidden, logits = self._forward_logits(self.prepare(plan))
        batch = build_sampling_batch(plan.sampling, self.vocab_size, self.device, self.stager)
        return ForwardedStep(plan, hidden, logits, batch)

    def _forward_logits(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Queue the forward of staged ``inputs`` (their pending rows taken): [T, hidden] and the
        sampled rows' [N, V] fp32 logits."""
        assert inputs.plan is not None
        self.copy_blocks(inputs.plan.blocks_to_copy)  # queued after the inputs' copies, before the forward
        hidden = self.forward(inputs)
        return hidden, self.sample_logits(hidden, inputs)

    @torch.inference_mode()
    def sample(self, step: ForwardedStep, bitmask: TokenBitmaskRows | None = None) -> LaunchedStep:
        """Queue the sampling of a forwarded step: ``bitmask``, grammar rows filled after the
        forward was launched, becomes the first logits processor (the plan's own, if any, was
        made one by :meth:`launch_forward`)."""
        return self._sample(step, bitmask)

    def _sample(self, step: ForwardedStep, bitmask: TokenBitmaskRows | None) -> LaunchedStep:
        plan, batch = step.plan, step.batch
        if bitmask is not None:
            assert plan.sampling.bitmask is None, "a step's grammar rows come once"
            plan.sampling.bitmask = bitmask
            batch.processors.insert(0, token_bitmask(bitmask, self.stager, plan.sampling.num_rows))
        out = self.sampler(step.logits, batch)
        prompt = self._prompt_logprobs(step.hidden, plan)
        results = [out.token_ids, out.logprobs, out.finite]  # a NaN row fails only its request
        if out.top_ids is not None and out.top_logprobs is not None:
            results += [out.top_ids, out.top_logprobs]
        transfer = DeviceToHost(self.device)
        host = transfer.fetch(results)
        self.last_sampled = out.token_ids
        return LaunchedStep(plan, out.token_ids, host, transfer, prompt)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """The model over the step's flat rows: [T] ids -> [T, hidden] (a captured CUDA graph
        when one fits)."""
        hidden = self.cuda_graphs.try_run(inputs) if self.cuda_graphs is not None else None
        if hidden is None:
            plan = self.backend.prepare(inputs.meta)  # once per step; every layer reads it
            with forward_context(ForwardContext(self.backend, self.kv_caches, inputs.meta, plan)), \
                    lora_batch(inputs.lora):
                hidden = self.model(inputs.input_ids, inputs.positions)  # [T, hidden]
        return hidden

    def sample_logits(self, hidden: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        """Logits of the rows that choose a token: [T, hidden] -> [N, V] fp32."""
        assert inputs.plan is not None
        rows = inputs.sample_rows if inputs.sample_rows is not None else \
            self.stager.to_device(inputs.plan.sample_rows, torch.int64)
        return self.model.compute_logits(hidden.index_select(0, rows))

    def finish(self, step: LaunchedStep) -> StepOutput:
        """Wait for a launched step and read its sampled tokens back: per sampled sequence a list
        of one token, or, for a sequence verifying drafts, the drafts the model agreed with and
        the token it chose after them (:func:`loom.sample.verify.accepted_prefix`)."""
        step.transfer.wait()
        plan = step.plan
        token_ids, logprobs = step.host[0].tolist(), step.host[1].tolist()
        finite = step.host[2].tolist()
        top_rows: list[list[tuple[int, float]]] | None = None
        if len(step.host) == 5:
            ids_l, lps_l = step.host[3].tolist(), step.host[4].tolist()
            # A -inf logprob marks a slot that holds no token the filters kept: fewer
            # alternatives than asked for come back, never a filtered-out one.
            top_rows = [[(t, lp) for t, lp in zip(i[:n], lps[:n], strict=True) if lp != _NO_TOKEN]
                        for n, i, lps in zip(plan.sampling.top_n, ids_l, lps_l, strict=True)]
        if plan.num_drafts is None:  # one row per sequence
            top = [[t] for t in top_rows] if top_rows is not None else None
            failed = {seq_id: _NON_FINITE for seq_id, ok in zip(plan.sample_seq_ids, finite, strict=True) if not ok}
            return StepOutput(plan.sample_seq_ids, [[t] for t in token_ids], [[lp] for lp in logprobs], top,
                              failed, step.prompt_logprobs)
        out_ids: list[list[int]] = []
        out_lps: list[list[float]] = []
        out_top: list[list[list[tuple[int, float]]]] | None = [] if top_rows is not None else None
        failed = {}
        row = draft = 0
        for seq_id, m in zip(plan.sample_seq_ids, plan.num_drafts, strict=True):
            chosen = token_ids[row : row + m + 1]
            keep = accepted_prefix(chosen, plan.draft_token_ids[draft : draft + m]) + 1
            out_ids.append(chosen[:keep])
            out_lps.append(logprobs[row : row + keep])
            if out_top is not None and top_rows is not None:
                out_top.append(top_rows[row : row + keep])
            if not all(finite[row : row + keep]):
                failed[seq_id] = _NON_FINITE
            row += m + 1
            draft += m
        return StepOutput(plan.sample_seq_ids, out_ids, out_lps, out_top, failed, step.prompt_logprobs)

    def _prompt_logprobs(self, hidden: torch.Tensor, plan: StepPlan) -> dict[int, list[float]]:
        """Logprobs of the prompt tokens this step's rows predict, per sequence (read back now)."""
        out: dict[int, list[float]] = {}
        for rows in plan.prompt_logprobs:
            count = len(rows.next_token_ids)
            values = out.setdefault(rows.seq_id, [])
            # In slices: a [count, V] fp32 logits block for a long prompt would dominate memory.
            for lo in range(0, count, _PROMPT_LOGPROB_ROWS):
                hi = min(count, lo + _PROMPT_LOGPROB_ROWS)
                logits = self.model.compute_logits(hidden[rows.first_row + lo : rows.first_row + hi])  # [hi-lo, V]
                nxt = torch.tensor(rows.next_token_ids[lo:hi], dtype=torch.int64, device=self.device)
                values.extend(prompt_logprobs(logits, nxt).tolist())
        return out


def _block_tables(tables: list[list[int]], width: int) -> array.array[int]:
    """The block tables as zero-padded rows of ``width``, flat (``[len(tables) * width]`` int32).
    Filled through an ``array``: 4x faster than ``torch.tensor`` of padded rows at 512
    sequences (0.7 ms vs 3.2 ms here), and this runs every step."""
    flat = array.array("i", bytes(4 * width * len(tables)))
    for i, table in enumerate(tables):
        flat[i * width : i * width + len(table)] = array.array("i", table)
    return flat
