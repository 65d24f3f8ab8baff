"""Hypothesis strategies for GenerateRequest / GenerateStreamRequest: every field, hostile values.

Sizes from empty to past the server's limits, any unicode (protobuf strings cannot carry lone
surrogates, so neither do these), the extremes of every integer type, NaN, infinities and
subnormals in every float, empty sub-messages and oneofs, and huge repeated fields. Every request
stays under gRPC's default 4 MiB message size so that the server, not the transport, answers.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from loom_client.v1 import generation_pb2 as pb

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
INT32 = (-(2**31), 2**31 - 1)


def mostly(sane: st.SearchStrategy[Any], hostile: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Sane values four times in five: requests that pass validation must be common too, or
    only the rejection paths get exercised."""
    return st.integers(0, 4).flatmap(lambda i: hostile if i == 0 else sane)


# The edges of each type and of the server's limits, then anything of the type.
uint32 = st.one_of(st.sampled_from([0, 1, 2, 1000, 1023, 1024, 49151, 49152, 2**31, UINT32_MAX]),
                   st.integers(0, UINT32_MAX))
uint64 = st.one_of(st.sampled_from([0, 2**63 - 1, 2**63, UINT64_MAX]), st.integers(0, UINT64_MAX))
int32 = st.one_of(st.sampled_from(INT32), st.integers(*INT32))
float32 = st.one_of(
    st.sampled_from([0.0, -0.0, 1e-45, -1e-45, 1e-38, 3.4e38, -3.4e38, float("nan"), float("inf"), float("-inf")]),
    st.floats(width=32, allow_nan=True, allow_infinity=True),
)
short_text = st.text(max_size=40)
# Past --max-input-chars (262,144 by default) sometimes; one repeated character keeps it quick.
huge_text = st.builds(lambda c, n: c * n, st.characters(codec="utf-8"), st.sampled_from([5_000, 262_144, 262_145, 300_000]))
text = mostly(st.text(min_size=1, max_size=200), st.one_of(st.just(""), huge_text))
token_ids = mostly(
    st.lists(st.integers(0, 49151), min_size=1, max_size=40),
    st.one_of(st.lists(uint32, max_size=20),
              st.builds(lambda i, n: [i] * n, st.integers(0, 49151), st.sampled_from([1000, 1001, 300_000]))),
)
roles = mostly(st.sampled_from(["system", "user", "assistant", "tool"]),
               st.one_of(st.sampled_from(["", "robot", "USER", "user "]), st.text(max_size=2000)))
chat = st.builds(
    pb.Chat,
    messages=mostly(st.lists(st.builds(pb.ChatMessage, role=roles, content=st.text(max_size=60)), min_size=1, max_size=5),
                    st.lists(st.builds(pb.ChatMessage, role=roles, content=st.text(max_size=5)), max_size=5000)),
)
stop_sequences = mostly(
    st.lists(st.text(min_size=1, max_size=5), max_size=4),
    st.one_of(st.lists(short_text, max_size=6), st.builds(lambda s, n: [s] * n, short_text, st.sampled_from([5, 1000])),
              st.lists(st.builds(lambda c: c * 300, st.characters(codec="utf-8")), max_size=2)),
)
stop_token_ids = mostly(
    st.lists(st.integers(0, 49151), max_size=4),
    st.one_of(st.lists(uint32, max_size=8), st.builds(lambda n: list(range(n)), st.sampled_from([1000, 100_000]))),
)


def _optional(draw: Any, strategy: st.SearchStrategy[Any]) -> Any:
    return draw(strategy) if draw(st.booleans()) else None


def _set(message: Any, **values: Any) -> None:
    for name, value in values.items():
        if value is not None:
            setattr(message, name, value)


@st.composite
def parameters(draw: Any) -> pb.Parameters | None:
    if draw(st.integers(0, 9)) == 0:
        return None
    p = pb.Parameters()
    if draw(st.booleans()):
        p.sampling.SetInParent()  # an empty sub-message is a case of its own
        _set(p.sampling, do_sample=draw(st.booleans()),
             temperature=_optional(draw, mostly(st.floats(0, 2, width=32), float32)),
             top_k=_optional(draw, mostly(st.integers(0, 100), uint32)),
             top_p=_optional(draw, mostly(st.floats(0.25, 1, width=32), float32)),
             typical_p=_optional(draw, mostly(st.floats(0.25, 1, width=32), float32)),
             min_p=_optional(draw, mostly(st.floats(0, 0.5, width=32), float32)),
             seed=_optional(draw, mostly(st.integers(0, 2**32), uint64)))
    if draw(st.booleans()):
        p.stopping.SetInParent()
        _set(p.stopping, max_new_tokens=_optional(draw, mostly(st.integers(1, 16), uint32)),
             ignore_eos=draw(st.booleans()), min_new_tokens=draw(mostly(st.integers(0, 2), uint32)),
             time_limit_ms=_optional(draw, mostly(st.integers(1, 10_000), uint32)),
             include_stop_sequence=draw(st.booleans()))
        p.stopping.stop_sequences.extend(draw(stop_sequences))
        p.stopping.stop_token_ids.extend(draw(stop_token_ids))
    if draw(st.booleans()):
        p.penalties.SetInParent()
        _set(p.penalties, repetition_penalty=_optional(draw, mostly(st.floats(0.5, 2, width=32), float32)),
             frequency_penalty=_optional(draw, mostly(st.floats(-2, 2, width=32), float32)),
             presence_penalty=_optional(draw, mostly(st.floats(-2, 2, width=32), float32)))
    if draw(st.booleans()):
        p.response.SetInParent()
        _set(p.response, tokens=draw(st.booleans()), logprobs=draw(st.booleans()),
             top_n_tokens=draw(mostly(st.integers(0, 5), uint32)), prompt_logprobs=draw(st.booleans()),
             return_full_text=draw(st.booleans()))
    _set(p, truncate_input_tokens=_optional(draw, mostly(st.integers(1, 1000), uint32)),
         n=_optional(draw, mostly(st.integers(1, 2), uint32)), best_of=_optional(draw, mostly(st.integers(1, 2), uint32)),
         priority=draw(mostly(st.integers(-5, 5), int32)))
    return p


@st.composite
def generate_fields(draw: Any) -> dict[str, Any]:
    """Keyword arguments for GenerateRequest(...) or GenerateStreamRequest(...)."""
    fields: dict[str, Any] = {"request_id": draw(mostly(st.one_of(st.just(""), short_text),
                                                         st.text(min_size=250, max_size=300)))}
    kind = draw(mostly(st.sampled_from(["text", "token_ids", "chat"]),
                       st.sampled_from(["none", "empty-chat", "empty-ids"])))
    if kind == "text":
        fields["text"] = draw(text)
    elif kind == "token_ids":
        fields["token_ids"] = pb.TokenIds(ids=draw(token_ids))
    elif kind == "chat":
        fields["chat"] = draw(chat)
        if draw(st.booleans()):
            fields["chat"].add_generation_prompt = draw(st.booleans())
    elif kind == "empty-chat":
        fields["chat"] = pb.Chat()
    elif kind == "empty-ids":
        fields["token_ids"] = pb.TokenIds()
    params = draw(parameters())
    if params is not None:
        fields["parameters"] = params
    return fields
