"""The prompt of a request: text, token ids or chat, checked and tokenized.

Structural checks (input set, not empty, known chat roles, ids in the vocabulary, special-token
parsing only turned off for text) report field violations; tokenizing happens only once they pass. Generate and Tokenize share this code so
they count tokens identically.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.frontend.tokenizer import ChatTemplateError, Tokenizer
from loom_client.v1 import generation_pb2 as pb

from .errors import FieldViolation, failed_precondition, in_all

# Roles every chat template understands; others are rejected rather than passed to a template
# that might silently drop them.
CHAT_ROLES = ("system", "user", "assistant", "tool")
# Rendering a chat costs template work per message even when the messages are empty; the
# character limit alone would let a 4 MiB request carry a million of them.
MAX_CHAT_MESSAGES = 4096
MAX_QUOTED_ROLE_CHARS = 32  # an unknown role is quoted back in the violation up to this long


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    text: str  # what return_full_text prepends: the text, rendered chat, or decoded ids
    field: str  # the request field the prompt came from, for violations about its length


def check_chat(chat: pb.Chat, prefix: str = "chat") -> list[FieldViolation]:
    if not chat.messages:
        return [FieldViolation(f"{prefix}.messages", "must contain at least one message")]
    unknown = [i for i, msg in enumerate(chat.messages) if msg.role not in CHAT_ROLES]
    if not unknown:
        return []
    i = unknown[0]
    role = chat.messages[i].role
    quoted = repr(role) if len(role) <= MAX_QUOTED_ROLE_CHARS else repr(role[:MAX_QUOTED_ROLE_CHARS]) + "..."
    return [FieldViolation(f"{prefix}.messages[{i}].role", f"unknown role {quoted}; use one of {', '.join(CHAT_ROLES)}"
                           + in_all(len(unknown), "messages with an unknown role"))]


def check_input(request: pb.GenerateRequest | pb.GenerateStreamRequest, vocab_size: int) -> list[FieldViolation]:
    kind = request.WhichOneof("input")
    if kind is None:
        return [FieldViolation("input", "set exactly one of text, token_ids or chat")]
    if kind == "text":
        return [] if request.text else [FieldViolation("text", "must not be empty")]
    if kind == "token_ids":
        ids = request.token_ids.ids
        if not ids:
            return [FieldViolation("token_ids.ids", "must contain at least one token id")]
        bad = [(i, t) for i, t in enumerate(ids) if t >= vocab_size]
        if bad:
            i, t = bad[0]
            return [FieldViolation(f"token_ids.ids[{i}]", f"token id {t} is not below the vocabulary size {vocab_size}"
                                   + in_all(len(bad), "such ids"))]
        return []
    return check_chat(request.chat)


def parses_special_tokens(request: pb.GenerateRequest | pb.GenerateStreamRequest | pb.TokenizeRequest) -> bool:
    """The request's parse_special_tokens: unset is true."""
    return request.parse_special_tokens if request.HasField("parse_special_tokens") else True


def check_special_token_parsing(request: pb.GenerateRequest | pb.GenerateStreamRequest | pb.TokenizeRequest
                                ) -> list[FieldViolation]:
    # A chat's rendered prompt must have its template's markers parsed; accepting false there
    # would promise a protection that the chat path cannot give (see Chat in the proto).
    if request.WhichOneof("input") == "chat" and not parses_special_tokens(request):
        return [FieldViolation("parse_special_tokens", "false applies to text input only: a chat is rendered "
                               "with its template's markup, which must become special tokens")]
    return []


def check_size(request: pb.GenerateRequest | pb.GenerateStreamRequest | pb.TokenizeRequest,
               max_chars: int) -> list[FieldViolation]:
    """Bound the work tokenizing costs (it runs on the event loop) before doing any of it."""
    kind = request.WhichOneof("input")
    if kind == "text" and len(request.text) > max_chars:
        return [FieldViolation("text", f"has {len(request.text)} characters, more than the server's "
                                       f"limit of {max_chars} (--max-input-chars)")]
    if kind == "token_ids" and len(request.token_ids.ids) > max_chars:  # type: ignore[union-attr]
        return [FieldViolation("token_ids.ids", f"has {len(request.token_ids.ids)} ids, more than the "  # type: ignore[union-attr]
                                                f"server's limit of {max_chars} (--max-input-chars)")]
    if kind == "chat":
        messages = request.chat.messages
        if len(messages) > MAX_CHAT_MESSAGES:
            return [FieldViolation("chat.messages", f"has {len(messages)} messages, more than {MAX_CHAT_MESSAGES}")]
        chars = sum(len(m.content) + len(m.role) for m in messages)
        if chars > max_chars:
            return [FieldViolation("chat.messages", f"has {chars} characters, more than the server's "
                                                    f"limit of {max_chars} (--max-input-chars)")]
    return []


def chat_messages(chat: pb.Chat) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in chat.messages]


def render_chat(tokenizer: Tokenizer, chat: pb.Chat) -> str:
    add_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    try:
        return tokenizer.render_chat(chat_messages(chat), add_generation_prompt=add_prompt)
    except ChatTemplateError as exc:
        raise failed_precondition(str(exc), "NO_CHAT_TEMPLATE" if not tokenizer.has_chat_template
                                  else "CHAT_TEMPLATE_ERROR") from exc


def tokenize_prompt(request: pb.GenerateRequest | pb.GenerateStreamRequest, tokenizer: Tokenizer) -> Prompt:
    """The prompt's token ids (check_input must have passed)."""
    kind = request.WhichOneof("input")
    if kind == "text":
        ids = tokenizer.encode(request.text, parse_special_tokens=parses_special_tokens(request))
        return Prompt(ids, request.text, "text")
    if kind == "token_ids":
        ids = list(request.token_ids.ids)
        return Prompt(ids, tokenizer.decode(ids, skip_special_tokens=False), "token_ids.ids")
    rendered = render_chat(tokenizer, request.chat)
    return Prompt(tokenizer.encode(rendered, add_special_tokens=False), rendered, "chat")
