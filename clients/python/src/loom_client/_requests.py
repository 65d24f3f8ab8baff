"""Request messages built from the clients' arguments; shared by the sync and async clients."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from .parameters import build_parameters
from .v1 import generation_pb2 as pb

if TYPE_CHECKING:
    from typing import TypeAlias

    from .parameters import ParameterOptions

__all__ = [
    "ChannelOptions",
    "ChatMessageLike",
    "Metadata",
    "build_chat",
    "chat_message",
    "generate_request",
    "merge_metadata",
    "tokenize_request",
]

# A chat turn: the message itself, {"role": ..., "content": ...}, or (role, content).
ChatMessageLike: TypeAlias = pb.ChatMessage | Mapping[str, str] | tuple[str, str]
# gRPC call metadata: (key, value) pairs; binary values need keys ending in "-bin".
Metadata: TypeAlias = Sequence[tuple[str, str | bytes]]
# gRPC channel arguments, e.g. ("grpc.max_receive_message_length", 64 << 20).
ChannelOptions: TypeAlias = Sequence[tuple[str, Any]]

_GenerateRequestT = TypeVar("_GenerateRequestT", pb.GenerateRequest, pb.GenerateStreamRequest)


def chat_message(message: ChatMessageLike) -> pb.ChatMessage:
    if isinstance(message, pb.ChatMessage):
        return message
    if isinstance(message, tuple):
        role, content = message
        return pb.ChatMessage(role=role, content=content)
    try:
        return pb.ChatMessage(role=message["role"], content=message["content"])
    except KeyError as exc:
        raise ValueError(f"a chat message needs 'role' and 'content', got keys {sorted(message)}") from exc


def build_chat(messages: Sequence[ChatMessageLike], add_generation_prompt: bool | None) -> pb.Chat:
    chat = pb.Chat(messages=[chat_message(m) for m in messages])
    if add_generation_prompt is not None:
        chat.add_generation_prompt = add_generation_prompt
    return chat


def _one_input(**inputs: object) -> str:
    given = [name for name, value in inputs.items() if value is not None]
    if len(given) != 1:
        names = ", ".join(inputs)
        raise ValueError(f"pass exactly one of {names}; got {', '.join(given) or 'none'}")
    return given[0]


def _check_text_only(which: str, parse_special_tokens: bool | None) -> None:
    if parse_special_tokens is not None and which != "text":
        raise ValueError("parse_special_tokens applies to text input only")


def generate_request(
    cls: type[_GenerateRequestT],
    text: str | None,
    token_ids: Sequence[int] | None,
    messages: Sequence[ChatMessageLike] | None,
    *,
    add_generation_prompt: bool | None,
    request_id: str,
    parameters: pb.Parameters | None,
    options: ParameterOptions,
    parse_special_tokens: bool | None = None,
    adapter_id: str = "",
) -> _GenerateRequestT:
    """A GenerateRequest or GenerateStreamRequest with exactly one input and the merged parameters
    (``adapter_id``: a loaded LoRA adapter's name; empty: the base model)."""
    request = cls(request_id=request_id, adapter_id=adapter_id)
    which = _one_input(text=text, token_ids=token_ids, messages=messages)
    _check_text_only(which, parse_special_tokens)
    if which == "text":
        assert text is not None
        request.text = text
        if parse_special_tokens is not None:
            request.parse_special_tokens = parse_special_tokens
    elif which == "token_ids":
        assert token_ids is not None
        request.token_ids.ids.extend(token_ids)
    else:
        assert messages is not None
        request.chat.CopyFrom(build_chat(messages, add_generation_prompt))
    if parameters is not None or options:
        request.parameters.CopyFrom(build_parameters(parameters, **options))
    return request


def tokenize_request(
    text: str | None,
    messages: Sequence[ChatMessageLike] | None,
    *,
    add_generation_prompt: bool | None,
    add_special_tokens: bool | None,
    return_offsets: bool,
    parse_special_tokens: bool | None = None,
) -> pb.TokenizeRequest:
    request = pb.TokenizeRequest(return_offsets=return_offsets)
    which = _one_input(text=text, messages=messages)
    _check_text_only(which, parse_special_tokens)
    if which == "text":
        assert text is not None
        request.text = text
        if parse_special_tokens is not None:
            request.parse_special_tokens = parse_special_tokens
    else:
        assert messages is not None
        request.chat.CopyFrom(build_chat(messages, add_generation_prompt))
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    return request


def merge_metadata(
    default: Metadata | None, extra: Metadata | None
) -> tuple[tuple[str, str | bytes], ...] | None:
    merged = (*(default or ()), *(extra or ()))
    return merged or None
