"""One request from engine outputs to chunks: every completion, the time limit, prompt tokens.

:func:`generate_chunks` drives the engine for a validated :class:`GenerationPlan` and yields the
chunks of all its completions as they come. Leaving it early (client cancel, every completion
ended by a stop string, time limit) closes the engine stream, which aborts the request in the
engine and frees its KV blocks at once. :func:`collect_completions` gathers the chunks for a unary
response and applies best_of.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from loom.engine.types import EngineOutput, EngineRequest, FinishReason

from .completion import Chunk, CompletionState, EngineRequestError, TextOptions, TokenInfo
from .tokenizer import Tokenizer


class EngineClient(Protocol):
    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]: ...


@dataclass(frozen=True)
class GenerationPlan:
    """A validated request, ready for the engine. ``engine_request.n`` is best_of (>= n)."""

    engine_request: EngineRequest
    n: int = 1
    text: TextOptions = field(default_factory=TextOptions)
    prompt_text: str = ""  # prepended to each completion's text when return_full_text
    return_full_text: bool = False
    prompt_logprobs: bool = False
    time_limit_s: float | None = None  # counted from arrival
    arrival: float = field(default_factory=time.monotonic)

    @property
    def best_of(self) -> int:
        return self.engine_request.n

    @property
    def request_id(self) -> str:
        return self.engine_request.request_id


@contextlib.asynccontextmanager
async def _closing(stream: AsyncIterator[EngineOutput]) -> AsyncIterator[None]:
    """Close the engine stream on the way out, whatever happened: that aborts the request."""
    try:
        yield
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


def prompt_token_infos(tokenizer: Tokenizer, ids: tuple[int, ...], logprobs: list[float | None]) -> list[TokenInfo]:
    return [
        TokenInfo(t, tokenizer.token_text(t), logprobs[i] if i < len(logprobs) else None, tokenizer.is_special(t))
        for i, t in enumerate(ids)
    ]


async def generate_chunks(engine: EngineClient, tokenizer: Tokenizer, plan: GenerationPlan) -> AsyncGenerator[Chunk, None]:
    """Chunks of every completion of ``plan`` (best_of of them), each completion's in order."""
    req = plan.engine_request
    states = [CompletionState(i, tokenizer, req.prompt_token_ids, plan.text) for i in range(req.n)]
    started = [False] * req.n
    stopped: set[int] = set()  # completions ended here whose engine sequences were stopped
    deadline = None if plan.time_limit_s is None else plan.arrival + plan.time_limit_s
    outputs = engine.generate(req)
    async with _closing(outputs):
        stream = aiter(outputs)
        while not all(s.finished for s in states):
            try:
                if deadline is None:
                    out = await anext(stream)
                else:
                    out = await asyncio.wait_for(anext(stream), max(0.0, deadline - time.monotonic()))
            except StopAsyncIteration:
                raise EngineRequestError("the engine ended the request before all completions finished") from None
            except asyncio.TimeoutError:
                for state in states:
                    chunk = state.finish(FinishReason.TIME_LIMIT)
                    if chunk is not None:
                        if not started[state.index] and plan.return_full_text:
                            chunk.text = plan.prompt_text + chunk.text
                        yield chunk
                return
            if not 0 <= out.index < len(states):
                raise EngineRequestError(f"the engine sent completion index {out.index} of {len(states)}")
            chunk = states[out.index].process(out)
            if len(states) > 1 and states[out.index].finished and not out.finished and out.index not in stopped:
                # Ended here (a stop string) while the others go on: stop computing it.
                stopped.add(out.index)
                abort_one = getattr(engine, "abort_completion", None)
                if abort_one is not None:
                    abort_one(req.request_id, out.index)
            if chunk is None:
                continue
            if not started[out.index]:
                started[out.index] = True
                if plan.return_full_text:
                    chunk.text = plan.prompt_text + chunk.text
            if plan.prompt_logprobs and out.prompt_logprobs is not None and out.index == 0:
                chunk.prompt_tokens = prompt_token_infos(tokenizer, req.prompt_token_ids, out.prompt_logprobs)
            yield chunk


@dataclass
class CompletionResult:
    index: int
    text: str = ""
    tokens: list[TokenInfo] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    generated_tokens: int = 0
    cumulative_logprob: float = 0.0
    seed: int | None = None


@dataclass
class GenerationResult:
    completions: list[CompletionResult]
    generated_tokens: int  # all candidates, best_of ones included
    cached_prompt_tokens: int = 0
    prompt_tokens: list[TokenInfo] | None = None
    draft_tokens: int = 0  # speculation, all candidates
    accepted_draft_tokens: int = 0


async def collect_completions(chunks: AsyncIterator[Chunk], plan: GenerationPlan) -> GenerationResult:
    """Gather every chunk; with best_of > n keep the n of highest cumulative logprob."""
    results = [CompletionResult(i) for i in range(plan.best_of)]
    prompt_tokens: list[TokenInfo] | None = None
    cached = 0
    drafts = [(0, 0)] * plan.best_of  # per completion: the latest (verified, accepted) counts
    async for chunk in chunks:
        cached = max(cached, chunk.cached_prompt_tokens)
        drafts[chunk.index] = (chunk.draft_tokens, chunk.accepted_draft_tokens)
        r = results[chunk.index]
        r.text += chunk.text
        r.tokens.extend(chunk.tokens)
        r.finish_reason = chunk.finish_reason
        r.generated_tokens = chunk.generated_tokens
        r.cumulative_logprob = chunk.cumulative_logprob
        r.seed = chunk.seed
        if chunk.prompt_tokens is not None:
            prompt_tokens = chunk.prompt_tokens
    total = sum(r.generated_tokens for r in results)
    chosen = results
    if plan.best_of > plan.n:
        chosen = sorted(results, key=lambda r: r.cumulative_logprob, reverse=True)[: plan.n]
        for i, r in enumerate(chosen):
            r.index = i
    return GenerationResult(chosen, total, cached, prompt_tokens, draft_tokens=sum(d for d, _ in drafts),
                            accepted_draft_tokens=sum(a for _, a in drafts))
