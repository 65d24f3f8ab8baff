"""One completion's text pipeline: engine tokens -> detokenizer -> stop strings -> chunks.

A :class:`CompletionState` turns the :class:`EngineOutput` s of one completion into
:class:`Chunk` s: the text the completion gained, the tokens behind it, and on the last chunk why
it finished. Stop strings and time limits are decided here, on the front end; EOS, stop token ids
and lengths by the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from loom.engine.types import EngineOutput, FinishReason, Rejection

from .detokenizer import IncrementalDetokenizer
from .stop_strings import StopStringMatcher
from .tokenizer import Tokenizer


class EngineRequestError(RuntimeError):
    """The engine failed this request (the message says why); other requests are unaffected.
    ``rejection``: the engine refused it for the request's own sake (e.g. its grammar did not
    compile in time), with the status to answer."""

    def __init__(self, message: str, rejection: Rejection | None = None) -> None:
        super().__init__(message)
        self.rejection = rejection


@dataclass(frozen=True)
class TopTokenInfo:
    id: int
    text: str
    logprob: float


@dataclass(frozen=True)
class TokenInfo:
    id: int
    text: str
    logprob: float | None
    special: bool
    top_tokens: tuple[TopTokenInfo, ...] = ()


@dataclass
class Chunk:
    """What one completion gained since its previous chunk."""

    index: int
    text: str = ""
    tokens: list[TokenInfo] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    generated_tokens: int = 0  # this completion's total so far
    cumulative_logprob: float = 0.0  # sum of its token logprobs so far (best_of ranks by it)
    seed: int | None = None
    cached_prompt_tokens: int = 0  # prompt tokens the engine reused from its prefix cache
    prompt_tokens: list[TokenInfo] | None = None  # first chunk of completion 0, when asked
    draft_tokens: int = 0  # speculation: drafts verified for this completion so far ...
    accepted_draft_tokens: int = 0  # ... and accepted

    def merge(self, later: Chunk) -> None:
        """Append a later chunk of the same completion (coalescing tokens ready together)."""
        self.text += later.text
        self.tokens.extend(later.tokens)
        self.finish_reason = later.finish_reason
        self.generated_tokens = later.generated_tokens
        self.cumulative_logprob = later.cumulative_logprob
        self.seed = later.seed if later.seed is not None else self.seed
        self.cached_prompt_tokens = max(self.cached_prompt_tokens, later.cached_prompt_tokens)
        self.draft_tokens, self.accepted_draft_tokens = later.draft_tokens, later.accepted_draft_tokens
        if later.prompt_tokens is not None:
            self.prompt_tokens = later.prompt_tokens


@dataclass(frozen=True)
class TextOptions:
    """The per-request settings the text pipeline needs."""

    stop_sequences: tuple[str, ...] = ()
    include_stop_sequence: bool = False
    min_new_tokens: int = 0
    want_tokens: bool = False
    want_logprobs: bool = False


class CompletionState:
    def __init__(self, index: int, tokenizer: Tokenizer, prompt_ids: Sequence[int], options: TextOptions) -> None:
        self.index = index
        self._tok = tokenizer
        self._opts = options
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._stops = StopStringMatcher(options.stop_sequences, options.include_stop_sequence)
        self.generated_tokens = 0
        self.cumulative_logprob = 0.0
        self.seed: int | None = None
        self.cached_prompt_tokens = 0
        self.draft_tokens = 0
        self.accepted_draft_tokens = 0
        self.finish_reason: FinishReason | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def token_info(self, token_id: int, logprob: float | None, top: Sequence[tuple[int, float]] = ()) -> TokenInfo:
        tops = tuple(TopTokenInfo(t, self._tok.token_text(t), lp) for t, lp in top)
        return TokenInfo(token_id, self._tok.token_text(token_id),
                         logprob if self._opts.want_logprobs else None, self._tok.is_special(token_id), tops)

    def process(self, out: EngineOutput) -> Chunk | None:
        """Consume one engine output; None when this completion had already finished."""
        if self.finished:
            return None  # e.g. a stop string ended it; the engine's later tokens are dropped
        if out.finish_reason is FinishReason.ERROR:
            raise EngineRequestError(out.error or "the engine failed this request", out.rejection)
        if out.finish_reason is FinishReason.ABORTED:
            raise EngineRequestError("the engine aborted this request")
        if out.seed is not None:
            self.seed = out.seed
        self.cached_prompt_tokens = max(self.cached_prompt_tokens, out.num_cached_tokens)
        self.draft_tokens += out.num_draft_tokens
        self.accepted_draft_tokens += out.num_accepted_draft_tokens
        chunk = Chunk(self.index, seed=self.seed)
        n = len(out.token_ids)
        for i, token_id in enumerate(out.token_ids):
            logprob = out.logprobs[i] if i < len(out.logprobs) else 0.0
            self.generated_tokens += 1
            self.cumulative_logprob += logprob
            if self._opts.want_tokens:
                top = out.top_tokens[i] if out.top_tokens is not None and i < len(out.top_tokens) else ()
                chunk.tokens.append(self.token_info(token_id, logprob, top))
            engine_finish = out.finish_reason if i == n - 1 else None
            # The EOS token's text is never part of the completion; a stop token's only when
            # include_stop_sequence asks for it.
            keep_text = engine_finish not in (FinishReason.EOS_TOKEN, FinishReason.STOP_SEQUENCE) or (
                engine_finish is FinishReason.STOP_SEQUENCE and self._opts.include_stop_sequence
            )
            delta = self._detok.add(token_id) if keep_text else ""
            active = self.generated_tokens >= self._opts.min_new_tokens
            result = self._stops.feed(delta, active)
            chunk.text += result.text
            if result.matched is not None:
                self.finish_reason = FinishReason.STOP_SEQUENCE
                break
            if engine_finish is not None:
                self._finish_text(chunk, engine_finish)
                break
        return self._stamp(chunk)

    def _finish_text(self, chunk: Chunk, reason: FinishReason) -> None:
        # Release what was held back: an incomplete character, then a partial stop sequence
        # (which the last characters may still complete).
        result = self._stops.feed(self._detok.flush(), active=True)
        chunk.text += result.text
        if result.matched is not None:
            self.finish_reason = FinishReason.STOP_SEQUENCE
            return
        chunk.text += self._stops.flush()
        self.finish_reason = reason

    def _stamp(self, chunk: Chunk) -> Chunk:
        chunk.finish_reason = self.finish_reason
        chunk.generated_tokens = self.generated_tokens
        chunk.cumulative_logprob = self.cumulative_logprob
        chunk.cached_prompt_tokens = self.cached_prompt_tokens
        chunk.draft_tokens, chunk.accepted_draft_tokens = self.draft_tokens, self.accepted_draft_tokens
        return chunk

    def finish(self, reason: FinishReason) -> Chunk | None:
        """End the completion from the front end (time limit); None if it had already ended."""
        if self.finished:
            return None
        chunk = Chunk(self.index, seed=self.seed)
        self._finish_text(chunk, reason)
        return self._stamp(chunk)
