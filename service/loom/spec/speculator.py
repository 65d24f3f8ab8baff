"""Which sequences of a scheduled step verify drafts, and how many.

After the scheduler has chosen a step, the speculator asks the proposer for drafts for its
decode rows, reserves KV slots for them (never preempting anyone: a sequence without room
decodes as usual) and widens those rows to 1 + m query tokens. The planner lays the drafts out as
inputs, the sampler chooses a token at every row, the worker keeps the accepted prefix
(``loom.sample.verify``) and the output processor applies it. The speculator then records how
many were accepted and steps aside where drafts do not pay:

- above ``max_batch_size`` running sequences (a step that large is compute-bound: the extra
  rows cost more than the tokens they save);
- for a sequence whose drafts keep being rejected: it decodes without drafts for a while
  (4 steps, doubling up to 64 while it stays low), then tries again;
- for requests that turn it off (``SamplingParams.speculate``), near ``max_new_tokens`` and the
  model's length (drafts never take a sequence past them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog

from loom.engine.block_manager import BlockManager
from loom.engine.scheduler import SchedulerOutput
from loom.engine.sequence import Sequence
from loom.plugin_api import DraftRequest, Proposer

log = structlog.get_logger(__name__)

_LOW_ACCEPTANCE = 0.2  # accepted / proposed, smoothed, below which a sequence backs off
_SMOOTHING = 0.5
_FIRST_BACKOFF, _MAX_BACKOFF = 4, 64


@dataclass
class _SeqStats:
    rate: float = 1.0  # smoothed acceptance
    backoff: int = 0  # steps to skip before drafting again
    next_backoff: int = _FIRST_BACKOFF


@dataclass
class SpeculationCounters:
    steps: int = 0  # steps that verified drafts
    draft_tokens: int = 0  # the proposer's drafts verified (not the filler that pads a uniform step)
    accepted_tokens: int = 0  # of those, accepted
    verifications: int = 0  # (sequence, step) pairs that verified drafts, filler-only ones included
    filler_tokens: int = 0  # filler verified so that a step keeps one query length (CUDA graphs)
    # Per draft position i (0 = the first draft), over verifications: a proposer's draft was
    # there; it was reached (every draft before it accepted); it was accepted
    proposed_at: list[int] = field(default_factory=list)
    reached_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    def acceptance_at(self) -> list[float]:
        """Of the drafts at position i, the share accepted."""
        return [a / p if p else 0.0 for p, a in zip(self.proposed_at, self.accepted_at, strict=True)]

    def conditional_acceptance_at(self) -> list[float]:
        """Of the drafts at position i whose earlier drafts were all accepted, the share accepted:
        the chain the cost model multiplies."""
        return [a / r if r else 0.0 for r, a in zip(self.reached_at, self.accepted_at, strict=True)]


class Speculator:
    def __init__(self, proposer: Proposer, num_speculative_tokens: int, max_batch_size: int, vocab_size: int,
                 max_model_len: int, pad_to_k: bool) -> None:
        self.proposer = proposer
        self.k = num_speculative_tokens
        self.max_batch_size = max_batch_size
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # On CUDA: pad a shorter guess to k (repeating its last token) so that steps whose every
        # sequence verifies have one query length, k + 1, that a captured graph serves.
        self.pad_to_k = pad_to_k
        self._stats: dict[int, _SeqStats] = {}
        self._live: dict[int, Sequence] = {}  # sequences the proposer may keep state for
        self._real: dict[int, int] = {}  # this step's drafts per seq_id that the proposer made (not filler)
        self.counters = SpeculationCounters()

    def add_drafts(self, sched: SchedulerOutput, block_manager: BlockManager,
                   num_running: int) -> dict[int, list[int]]:
        """Drafts per seq_id for ``sched``'s decode rows; widens those rows and reserves their
        slots. Empty when the batch is too large or no sequence gets a guess."""
        self.release_finished()
        if num_running > self.max_batch_size:
            return {}
        # (row, sequence, room for drafts, width it may verify); width > room only for a sequence
        # near its max_new_tokens on CUDA: tokens past that limit are verified but never output.
        candidates: list[tuple[int, Sequence, int, int]] = []
        # Sequences backing off get no proposal of their own, and sequences with no room left
        # before max_new_tokens none at all; on CUDA, once another row verifies, they verify too (a
        # proposal if the proposer has one, else filler) so that the step keeps one query length
        # (see `uniform` below).
        resting: list[tuple[int, Sequence, int, int, list[int]]] = []
        for i, (seq, n) in enumerate(zip(sched.seqs, sched.num_new_tokens, strict=True)):
            if (n != 1 or not seq.sampling.speculate or seq.num_output_tokens == 0 or seq.num_pending_tokens
                    or seq.num_computed_tokens != seq.num_tokens - 1):
                continue  # not a plain decode row: prompts, forks and placeholders decode as usual
            model_room = self.max_model_len - seq.num_tokens - 1  # positions past it have no KV slot
            room = min(self.k, seq.stopping.max_new_tokens - seq.num_output_tokens - 1, model_room)
            width = min(self.k, model_room) if self.pad_to_k else room
            stats = self._stats.get(seq.seq_id)
            if stats is not None and stats.backoff > 0:
                stats.backoff -= 1
                if width > 0:
                    resting.append((i, seq, max(room, 0), width, []))
                continue
            if room > 0:
                candidates.append((i, seq, room, width))
            elif width > 0:
                resting.append((i, seq, 0, width, []))  # no room to propose for: filler only
        if not candidates:
            return {}
        guesses = self.proposer.propose([DraftRequest(s.seq_id, s.token_ids, room) for _, s, room, _ in candidates])
        drafts: dict[int, list[int]] = {}
        guessed = [(i, seq, room, width, _valid_prefix(guess[:room], self.vocab_size))
                   for (i, seq, room, width), guess in zip(candidates, guesses, strict=True)]
        asking = [r for r in resting if r[2] > 0]
        if self.pad_to_k and asking and any(g for *_, g in guessed):
            # The step will verify k tokens on every row (below): a resting row pays for them
            # anyway, so it verifies its proposer's guess rather than filler (W5 a at batch 16:
            # filler drafts on resting rows were rejected and pulled acceptance to 0.62).
            rest_guesses = iter(self.proposer.propose([DraftRequest(s.seq_id, s.token_ids, room)
                                                       for _, s, room, _, _ in asking]))
            resting = [(i, seq, room, width, _valid_prefix(next(rest_guesses)[:room], self.vocab_size))
                       if room > 0 else (i, seq, room, width, guess) for i, seq, room, width, guess in resting]
        guessed += resting
        # On CUDA, once some sequence verifies drafts, every decode row of the step does (a
        # sequence without a guess, backing off after rejections, or at its max_new_tokens,
        # repeats its last token): a step whose rows all have k + 1 tokens replays a captured
        # graph, where a mix of 1 and k + 1 runs eagerly (measured: SmolLM2 at batch 16, 21 ms a
        # step eagerly against 1.6 ms for a plain graphed step). Backing-off rows broke this
        # before: at batch 16 some row nearly always rests, so nearly every step ran eagerly (W5 a
        # at batch 16: 0.20x).
        uniform = (self.pad_to_k and any(g for *_, g in guessed) and len(guessed) == len(sched.seqs)
                   and all(width == self.k for _, _, _, width, _ in guessed))
        self._real = {}
        for i, seq, room, width, guess in guessed:
            self._live[seq.seq_id] = seq
            real = len(guess)
            if not guess and not uniform:
                continue
            if self.pad_to_k and len(guess) < width and (uniform or room == self.k):
                filler = guess[-1] if guess else seq.token_ids[-1]
                guess = guess + [filler] * (width - len(guess))
            if block_manager.num_new_blocks_needed(seq, 1 + len(guess)) > block_manager.num_free_blocks:
                continue  # no room for the drafts' KV: decode as usual rather than preempt
            block_manager.append_slots(seq, 1 + len(guess))
            sched.num_new_tokens[i] = 1 + len(guess)
            drafts[seq.seq_id] = guess
            self._real[seq.seq_id] = real
        if drafts:
            self.counters.steps += 1
        return drafts

    def will_propose(self, seqs: list[Sequence]) -> bool:
        """Whether the next step's :meth:`add_drafts` may ask the proposer for some of ``seqs``
        (it needs their tokens on the host): a sequence that speculates, is not backing off and
        has room before max_new_tokens. When none will, the step can be launched while the
        previous one is still in flight (the engine then calls :meth:`rest` for it)."""
        if len(seqs) > self.max_batch_size:
            return False
        for seq in seqs:
            if not seq.sampling.speculate or seq.stopping.max_new_tokens - seq.num_output_tokens - 1 <= 0:
                continue
            stats = self._stats.get(seq.seq_id)
            if stats is None or stats.backoff == 0:
                return True
        return False

    def rest(self, sched: SchedulerOutput) -> None:
        """A step launched without asking for drafts (none would have been asked for): the
        sequences backing off count it, as :meth:`add_drafts` would have."""
        for seq in sched.seqs:
            stats = self._stats.get(seq.seq_id)
            if stats is not None and stats.backoff > 0:
                stats.backoff -= 1

    def reset(self) -> None:
        """Forget every sequence and count (after the warm-up)."""
        for sid in list(self._live):
            self.proposer.release(sid)
        self._live.clear()
        self._stats.clear()
        self.counters = SpeculationCounters()

    def proposed(self, seq_id: int, num_drafts: int) -> int:
        """How many of the ``num_drafts`` a sequence verified this step the proposer made (the
        rest is filler that keeps the step uniform): what usage and metrics report as drafts."""
        return self._real.get(seq_id, num_drafts)

    def observe(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """Record a verification's outcome (and tell the proposer). The counters, the back-off
        and the proposer see the proposer's own drafts; filler is counted apart."""
        c = self.counters
        real = self.proposed(seq.seq_id, num_drafts)
        c.verifications += 1
        c.filler_tokens += num_drafts - real  # num_drafts: every draft verified, filler included
        num_drafts, num_accepted = real, min(num_accepted, real)
        c.draft_tokens += num_drafts
        c.accepted_tokens += num_accepted
        if len(c.proposed_at) < num_drafts:
            grow = num_drafts - len(c.proposed_at)
            c.proposed_at += [0] * grow
            c.reached_at += [0] * grow
            c.accepted_at += [0] * grow
        for i in range(num_drafts):
            c.proposed_at[i] += 1
            c.reached_at[i] += i <= num_accepted
            c.accepted_at[i] += i < num_accepted
        if num_drafts == 0:
            return  # filler only (a uniform step): says nothing about this sequence's drafts
        stats = self._stats.setdefault(seq.seq_id, _SeqStats())
        stats.rate = _SMOOTHING * stats.rate + (1 - _SMOOTHING) * (num_accepted / num_drafts)
        if stats.rate < _LOW_ACCEPTANCE:
            stats.backoff = stats.next_backoff
            stats.next_backoff = min(_MAX_BACKOFF, 2 * stats.next_backoff)
            stats.rate = _LOW_ACCEPTANCE  # one good verification after the pause lifts it again
        elif num_accepted == num_drafts:
            stats.next_backoff = _FIRST_BACKOFF
        self.proposer.accepted(seq.seq_id, num_drafts, num_accepted)

    def release_finished(self) -> None:
        """Let the proposer drop the state of sequences that have finished."""
        done = [sid for sid, seq in self._live.items() if seq.is_finished]
        for sid in done:
            del self._live[sid]
            self._stats.pop(sid, None)
            self.proposer.release(sid)


def _valid_prefix(tokens: list[int], vocab_size: int) -> list[int]:
    """A proposer's guess up to its first id outside the vocabulary (a plugin's bug must not
    reach the model as an out-of-range index)."""
    for j, t in enumerate(tokens):
        if not (isinstance(t, int) and 0 <= t < vocab_size):
            return tokens[:j]
    return list(tokens)
