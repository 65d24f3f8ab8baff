"""Front-end results -> loom.v1 response messages."""

from __future__ import annotations

from collections.abc import Sequence

from loom.engine.types import FinishReason
from loom.frontend.completion import Chunk, TokenInfo
from loom.frontend.generation import GenerationPlan, GenerationResult
from loom_client.v1 import generation_pb2 as pb

_FINISH = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.EOS_TOKEN: pb.FINISH_REASON_EOS_TOKEN,
    FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE,
    FinishReason.TIME_LIMIT: pb.FINISH_REASON_TIME_LIMIT,
}


def finish_reason(reason: FinishReason | None) -> pb.FinishReason.ValueType:
    return _FINISH.get(reason, pb.FINISH_REASON_UNSPECIFIED)


def token_message(info: TokenInfo) -> pb.Token:
    msg = pb.Token(id=info.id, text=info.text, special=info.special)
    if info.logprob is not None:
        msg.logprob = info.logprob
    for top in info.top_tokens:
        msg.top_tokens.add(id=top.id, text=top.text, logprob=top.logprob)
    return msg


def token_messages(infos: Sequence[TokenInfo]) -> list[pb.Token]:
    return [token_message(t) for t in infos]


def _seed(seed: int | None, plan: GenerationPlan) -> int | None:
    # Reported only for sampled completions; uint64 on the wire.
    if seed is None or not plan.engine_request.sampling.do_sample:
        return None
    return seed % (1 << 64)


def stream_message(chunk: Chunk, plan: GenerationPlan) -> pb.GenerateStreamResponse:
    msg = pb.GenerateStreamResponse(
        request_id=plan.request_id,
        index=chunk.index,
        text=chunk.text,
        tokens=token_messages(chunk.tokens),
        finish_reason=finish_reason(chunk.finish_reason),
    )
    if chunk.prompt_tokens is not None:
        msg.prompt_tokens.extend(token_messages(chunk.prompt_tokens))
    if chunk.finish_reason is not None:
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=len(plan.engine_request.prompt_token_ids),
                                    generated_tokens=chunk.generated_tokens,
                                    cached_prompt_tokens=chunk.cached_prompt_tokens,
                                    draft_tokens=chunk.draft_tokens,
                                    accepted_draft_tokens=chunk.accepted_draft_tokens))
        seed = _seed(chunk.seed, plan)
        if seed is not None:
            msg.seed = seed
    return msg


def generate_response(result: GenerationResult, plan: GenerationPlan) -> pb.GenerateResponse:
    resp = pb.GenerateResponse(
        request_id=plan.request_id,
        usage=pb.Usage(prompt_tokens=len(plan.engine_request.prompt_token_ids),
                       generated_tokens=result.generated_tokens,
                       cached_prompt_tokens=result.cached_prompt_tokens,
                       draft_tokens=result.draft_tokens,
                       accepted_draft_tokens=result.accepted_draft_tokens),
    )
    for c in result.completions:
        comp = resp.completions.add(index=c.index, text=c.text, finish_reason=finish_reason(c.finish_reason),
                                    generated_tokens=c.generated_tokens, tokens=token_messages(c.tokens))
        seed = _seed(c.seed, plan)
        if seed is not None:
            comp.seed = seed
    if result.prompt_tokens is not None:
        resp.prompt_tokens.extend(token_messages(result.prompt_tokens))
    return resp
