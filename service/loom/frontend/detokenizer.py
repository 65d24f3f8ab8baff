"""Incremental detokenization: the text each new token adds, correct across split characters.

Decoding tokens one by one is wrong twice over: a multi-byte character split across byte-level
tokens decodes as U+FFFD halves, and SentencePiece-style decoders drop a token's leading space
when it starts the decoded text. So each step decodes a short window twice, without and with the
new tokens, and emits the difference, but only once it no longer ends in U+FFFD (the rest of the
character is still to come). ``prefix`` is where the window starts, ``read`` where the text
already emitted ends.
"""

from __future__ import annotations

from collections.abc import Sequence

from .tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as context, so that the first generated token decodes as it would mid-text.
PROMPT_CONTEXT_TOKENS = 5
_TRIM_AT = 256  # drop ids before the window once this many have piled up


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        # A prompt that ends inside a character cannot serve as context: its U+FFFD tail would
        # turn into a real character and shift every offset.
        if context and self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []
        self._ids: list[int] = context
        self._prefix = 0
        self._read = len(context)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Append one token; return the text that is now final (possibly empty)."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith(REPLACEMENT_CHAR):
            return ""
        delta = after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        if self._prefix >= _TRIM_AT:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return delta

    def flush(self) -> str:
        """Text still held back at the end of the sequence (an incomplete character as U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return after[len(before) :] if len(after) > len(before) else ""
