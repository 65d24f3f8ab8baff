"""The model's tokenizer as the front end uses it: encode, render chat, decode single tokens.

Generate and Tokenize both go through :meth:`Tokenizer.encode`, so they count tokens identically.
Decoding uses the Rust ``tokenizers`` backend directly: it is what transformers calls underneath,
without the Python-side clean-up of spaces that would make incremental and whole decodes differ.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ChatTemplateError(ValueError):
    """The model has no chat template, or its template rejected the conversation."""


@dataclass(frozen=True)
class TokenSpan:
    """One token of an encoded text; ``start``/``end`` are code-point offsets, None for added tokens."""

    id: int
    start: int | None
    end: int | None


class Tokenizer:
    """Wraps a transformers fast tokenizer loaded from a Hugging Face model directory."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self._hf = hf_tokenizer
        self._backend = hf_tokenizer.backend_tokenizer
        special = set(hf_tokenizer.all_special_ids)
        for token_id, added in getattr(hf_tokenizer, "added_tokens_decoder", {}).items():
            if getattr(added, "special", False):
                special.add(int(token_id))
        self.special_ids: frozenset[int] = frozenset(special)
        self._piece_cache: dict[int, str] = {}

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> Tokenizer:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(model_dir))
        if not hasattr(hf, "backend_tokenizer"):
            raise ValueError(f"{model_dir}: Loom needs a fast (tokenizer.json) tokenizer")
        return cls(hf)

    # -- facts --------------------------------------------------------------------------------
    @property
    def hf_tokenizer(self) -> Any:
        """The transformers tokenizer itself (structured output describes its vocabulary)."""
        return self._hf

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can decode (the model's embedding may be larger)."""
        return len(self._hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._hf, "chat_template", None))

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    # -- encoding -----------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True, parse_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids.

        ``add_special_tokens``: add what the tokenizer adds around a text (a BOS...).
        ``parse_special_tokens``: markup spelling a special token ("<|im_start|>") becomes that
        token; False tokenizes it as the ordinary characters it is (transformers'
        ``split_special_tokens``, which it applies to the Rust tokenizer at each call, so one
        request's choice never carries over to the next), so untrusted text cannot forge chat
        turns or an EOS.
        """
        return list(self._hf(text, add_special_tokens=add_special_tokens,
                             split_special_tokens=not parse_special_tokens)["input_ids"])

    def encode_with_offsets(self, text: str, add_special_tokens: bool = True,
                            parse_special_tokens: bool = True) -> list[TokenSpan]:
        """Like :meth:`encode`, with where each token lies in ``text``."""
        enc = self._hf(text, add_special_tokens=add_special_tokens, split_special_tokens=not parse_special_tokens,
                       return_offsets_mapping=True, return_special_tokens_mask=True)
        spans = []
        for token_id, (start, end), added in zip(enc["input_ids"], enc["offset_mapping"],
                                                 enc["special_tokens_mask"], strict=True):
            # Tokens the tokenizer added (BOS...) have no counterpart in the text; an empty
            # span at 0 is how transformers marks them.
            if added and start == end:
                spans.append(TokenSpan(int(token_id), None, None))
            else:
                spans.append(TokenSpan(int(token_id), int(start), int(end)))
        return spans

    def render_chat(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation as the prompt text the model's chat template makes of it."""
        if not self.has_chat_template:
            raise ChatTemplateError("this model has no chat template; send text or token_ids input instead")
        try:
            rendered = self._hf.apply_chat_template(
                [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # jinja raises its own errors (raise_exception in templates)
            raise ChatTemplateError(f"the model's chat template rejected the conversation: {exc}") from exc
        return str(rendered)

    def encode_chat(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> list[int]:
        # The template writes its own special tokens (BOS included), so none are added again.
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)

    # -- decoding -----------------------------------------------------------------------------
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """One token decoded on its own (special tokens included; a partial character is U+FFFD)."""
        text = self._piece_cache.get(token_id)
        if text is None:
            text = self._piece_cache[token_id] = self.decode([token_id], skip_special_tokens=False)
        return text
