"""The model's vocabulary described to xgrammar: what text each token id stands for.

Built from the Hugging Face tokenizer beside the model (byte-level BPE, SentencePiece with byte
fallback, tiktoken...) with the model's logits width as the vocabulary size, so a bitmask row
covers every logit; the model's EOS ids are the tokens that end a match. Both processes build
it: the front end once at start, to answer FAILED_PRECONDITION for a vocabulary xgrammar cannot
describe before any request is queued; the engine for its compiler.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .grammars import clean_error

if TYPE_CHECKING:
    import xgrammar


class VocabularyError(RuntimeError):
    """The vocabulary cannot be described to xgrammar; the message says why."""


def describe_vocabulary(hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> xgrammar.TokenizerInfo:
    """xgrammar's ``TokenizerInfo`` for ``hf_tokenizer`` (a transformers tokenizer) and a model
    with ``vocab_size`` logits (raises :class:`VocabularyError`)."""
    import xgrammar as xg

    stops = [t for t in eos_token_ids if 0 <= t < vocab_size]
    if not stops:
        raise VocabularyError("the model has no EOS token id below its vocabulary size, so a constrained "
                              "completion could never end")
    try:
        info = xg.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
    except Exception as exc:  # xgrammar raises ValueError / RuntimeError for tokenizers it cannot read
        raise VocabularyError(f"xgrammar cannot describe this tokenizer's vocabulary: {clean_error(exc)}") from exc
    if info.vocab_size != vocab_size:
        raise VocabularyError(f"xgrammar described {info.vocab_size} tokens, the model has {vocab_size} logits")
    return info


def vocabulary_from_model_dir(model_dir: str | Path, vocab_size: int,
                              eos_token_ids: Sequence[int]) -> xgrammar.TokenizerInfo:
    """:func:`describe_vocabulary` for the tokenizer files of ``model_dir``."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:
        raise VocabularyError(f"cannot load the tokenizer of {model_dir}: {exc}") from exc
    return describe_vocabulary(tokenizer, vocab_size, eos_token_ids)
