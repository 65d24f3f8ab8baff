"""A step's results -> sequences and outputs: the only place that changes sequences after a step.

For every sequence that chose tokens, the worker's :class:`~loom.worker.step_plan.StepOutput`
holds a list of them (one per step today; several once drafts are verified). They replace the
sequence's placeholders (the tokens the host had not read back when the next step was prepared)
or extend it, each is checked for a stop condition in order, and a sequence that stops drops the
tokens after its last one and frees its blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from loom.worker.step_plan import StepOutput

from .block_manager import BlockManager
from .scheduler import Scheduler
from .sequence import Sequence, SequenceStatus
from .step_planner import PlannedStep
from .types import EngineOutput, FinishReason, Rejection

if TYPE_CHECKING:
    from loom.structured.driver import Refusal, StructuredOutput
    from loom.structured.grammar_group import GrammarProcessGroup
    from loom.structured.grammar_process import GrammarProcess

log = structlog.get_logger(__name__)


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, block_manager: BlockManager, requests: dict[str, list[Sequence]],
                 eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.requests = requests  # the engine's: request id -> its completions
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        # structured output's matchers (set by the engine once a request has a grammar)
        self.grammars: StructuredOutput | GrammarProcess | GrammarProcessGroup | None = None

    def process(self, planned: PlannedStep, positions: list[int], result: StepOutput,
                scheduled: list[Sequence], proposed: Callable[[int, int], int] | None = None) -> list[EngineOutput]:
        """Apply ``result`` (the step of ``planned``; ``positions[i]`` is where sampled sequence
        i's first new token goes) and return the outputs it makes. ``proposed(seq_id, m)``: how
        many of a sequence's ``m`` verified drafts the proposer made (the rest is filler, which
        usage and metrics do not count as drafts)."""
        self._prompt_logprobs(planned, result)
        outputs: list[EngineOutput] = []
        refusals = self._grammar_accepts(planned, result) if (
            self.grammars is not None and self.grammars.any_matched(planned.sample_seqs)) else {}
        for i, seq in enumerate(planned.sample_seqs):
            if seq.is_finished:
                continue  # finished or aborted while the step ran, or failed earlier in it
            error = result.failed.get(seq.seq_id)
            if error is not None:
                seq.token_ids[positions[i]] = result.token_ids[i][0]
                seq.num_pending_tokens -= 1
                outputs += self.fail_request(seq.request_id, error)
                continue
            refusal = refusals.get(seq.seq_id)
            if refusal is not None:  # its grammar's matcher could not follow
                seq.token_ids[positions[i]] = result.token_ids[i][0]
                seq.num_pending_tokens -= 1
                outputs += self.fail_request(seq.request_id, refusal.message, refusal.rejection)
                continue
            top = result.top_tokens[i] if result.top_tokens is not None else None
            out = self._accept(seq, positions[i], result.token_ids[i], result.logprobs[i], top)
            drafts = planned.plan.num_drafts[i] if planned.plan.num_drafts is not None else 0
            if drafts:
                # The step computed the last token and the drafts; the KV of those accepted is
                # valid, that of the rest is stale and is overwritten by later steps.
                accepted = len(result.token_ids[i]) - 1
                real = proposed(seq.seq_id, drafts) if proposed is not None else drafts
                out.num_draft_tokens, out.num_accepted_draft_tokens = real, min(accepted, real)
                if not seq.is_finished:
                    seq.num_computed_tokens = positions[i] + accepted
            outputs.append(out)
        for seq in scheduled:
            if not seq.is_finished:  # blocks that filled while their last token was on the device
                self.block_manager.register_full_blocks(seq)
        return outputs

    def _grammar_accepts(self, planned: PlannedStep, result: StepOutput) -> dict[int, Refusal]:
        """The matchers take the step's tokens; the refusals by seq_id. The driver turns a fault of
        one matcher into a refusal of its own request; should accepting still raise (a fault
        outside xgrammar), every constrained sequence of the step is refused (INTERNAL,
        GRAMMAR_MATCHER_FAULT) and the others go on."""
        grammars = self.grammars
        assert grammars is not None
        items = [(seq, tokens) for seq, tokens in zip(planned.sample_seqs, result.token_ids, strict=True)
                 if not seq.is_finished and seq.seq_id not in result.failed]
        try:
            return grammars.accept_step(items)
        except Exception as exc:
            refused = {seq.seq_id: r for seq, _ in items
                       if (r := grammars.host_fault(seq, "accepting this step's tokens", exc)) is not None}
            log.error("the grammar's matchers failed to accept the step's tokens: its constrained requests fail, "
                      "the others go on", requests=sorted({r.request_id for r in refused.values()}),
                      error=repr(exc), exc_info=exc)
            return refused

    def _prompt_logprobs(self, planned: PlannedStep, result: StepOutput) -> None:
        """Accumulate prompt logprobs on the sequence, chunk by chunk (``seq.prompt_logprobs``)."""
        if not planned.plan.prompt_logprobs:
            return
        by_id = {s.seq_id: s for s in planned.prompt_seqs}
        for rows in planned.plan.prompt_logprobs:
            seq = by_id[rows.seq_id]
            if rows.first_position == 0:
                seq.prompt_logprobs = [None]
            seq.prompt_logprobs.extend(result.prompt_logprobs.get(rows.seq_id, ()))

    def _accept(self, seq: Sequence, pos: int, tokens: list[int], logprobs: list[float],
                top: list[list[tuple[int, float]]] | None) -> EngineOutput:
        """Put ``tokens`` in place from ``pos`` on (the first over its placeholder), checking each
        for a stop condition; the output holds those up to the one that stops ``seq``."""
        reason: FinishReason | None = None
        taken = 0
        for k, token in enumerate(tokens):
            p = pos + k
            if k == 0:
                seq.token_ids[p] = token
                seq.num_pending_tokens -= 1
            else:  # accepted drafts: only while no later step is in flight for this sequence
                assert seq.num_pending_tokens == 0 and p == seq.num_tokens, seq
                seq.token_ids.append(token)
            seq.cumulative_logprob += logprobs[k]
            taken = k + 1
            reason = self.finish_reason(seq, token, p)
            if reason is not None:
                break
        out = EngineOutput(
            request_id=seq.request_id,
            index=seq.index,
            token_ids=list(tokens[:taken]),
            logprobs=list(logprobs[:taken]),
            top_tokens=list(top[:taken]) if top is not None else None,
            finish_reason=reason,
            seed=seq.seed,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            first_scheduled_time=seq.first_scheduled_time,
        )
        if seq.sampling.prompt_logprobs and not seq.prompt_logprobs_sent:
            out.prompt_logprobs = seq.prompt_logprobs
            seq.prompt_logprobs_sent = True
        if reason is not None:
            # tokens sampled after this one (the step in flight) are not part of the output
            del seq.token_ids[pos + taken :]
            seq.num_pending_tokens = 0
            self.finish(seq, reason)
        return out

    def finish_reason(self, seq: Sequence, token: int, pos: int) -> FinishReason | None:
        """Why ``seq`` ends with ``token`` at position ``pos`` (None: it goes on)."""
        st = seq.stopping
        if token in self.eos_token_ids and self.grammars is not None and self.grammars.terminated(seq):
            return FinishReason.EOS_TOKEN  # its grammar matched a whole sentence, then EOS
        num_output = pos + 1 - seq.num_prompt_tokens
        past_min = num_output >= st.min_new_tokens
        if past_min and not st.ignore_eos and token in self.eos_token_ids:
            return FinishReason.EOS_TOKEN
        if past_min and token in st.stop_token_ids:
            return FinishReason.STOP_SEQUENCE
        if num_output >= st.max_new_tokens or pos + 1 >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        seqs = self.requests.get(seq.request_id, [])
        if all(s.status is SequenceStatus.FINISHED for s in seqs):
            self.requests.pop(seq.request_id, None)

    def fail_request(self, request_id: str, message: str, rejection: Rejection | None = None) -> list[EngineOutput]:
        """End every completion of ``request_id`` with an error (a ``rejection`` when the request
        is refused rather than failed); its blocks are freed."""
        outs = []
        for seq in self.requests.pop(request_id, []):
            if not seq.is_finished:
                outs.append(EngineOutput(seq.request_id, seq.index, [], [], finish_reason=FinishReason.ERROR,
                                         error=message, rejection=rejection, seed=seq.seed,
                                         num_prompt_tokens=seq.num_prompt_tokens))
                seq.finish_reason = FinishReason.ERROR
                self.scheduler.remove(seq)
        return outs

