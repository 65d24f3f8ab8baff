"""Incremental detokenization and stop strings on the real SmolLM2 tokenizer (byte-level BPE)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loom.engine.types import EngineOutput, FinishReason
from loom.frontend.completion import CompletionState, TextOptions
from loom.frontend.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from loom.frontend.stop_strings import StopStringMatcher
from loom.frontend.tokenizer import Tokenizer

TEXTS = [
    "The capital of France is Paris.",
    "héllo wörld, naïve café",
    "日本語のテキストです。",
    "emoji 🙂🚀 and flags 🇫🇷 done",
    "  leading spaces\n\nand newlines\t tabs",
]


@pytest.fixture(scope="module")
def tok(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(default_model_dir)


def stream(tok: Tokenizer, ids: list[int], prompt: list[int] | None = None) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt or [])
    deltas = [detok.add(t) for t in ids]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_whole_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    deltas = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert all(REPLACEMENT_CHAR not in d for d in deltas)


def test_multibyte_character_split_across_tokens_is_held_back(tok: Tokenizer) -> None:
    ids = tok.encode("日本", add_special_tokens=False)
    assert len(ids) > 2  # the tokenizer splits at least one character into byte tokens
    per_token = [tok.token_text(t) for t in ids]
    assert any(REPLACEMENT_CHAR in p for p in per_token)  # Token.text shows the halves as U+FFFD
    deltas = stream(tok, ids)
    assert "".join(deltas) == "日本"
    assert "" in deltas  # some token released nothing: its character was incomplete


def test_incomplete_character_at_the_end_is_flushed_as_replacement(tok: Tokenizer) -> None:
    ids = tok.encode("日", add_special_tokens=False)
    assert len(ids) > 1
    deltas = stream(tok, ids[:-1])
    assert deltas[-1].endswith(REPLACEMENT_CHAR) and all(d == "" for d in deltas[:-1])


def test_prompt_context_does_not_leak_into_the_output(tok: Tokenizer) -> None:
    prompt = tok.encode("Question: what is it?", add_special_tokens=False)
    ids = tok.encode(" It is Paris.", add_special_tokens=False)
    assert "".join(stream(tok, ids, prompt)) == " It is Paris."


def test_stop_matcher_holds_back_partial_matches() -> None:
    m = StopStringMatcher(["</end>"])
    out = [m.feed(t).text for t in ["Hello <", "/e", "nd", "> tail"]]
    assert out == ["Hello ", "", "", ""]
    assert m.matched == "</end>"


def test_stop_matcher_releases_a_false_start() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("a ST").text == "a "
    assert m.feed("ay").text == "STay"
    assert m.feed(" S").text == " "
    assert m.flush() == "S"


def test_stop_matcher_include_and_earliest_match() -> None:
    m = StopStringMatcher(["lo", "hel"], include_stop_sequence=True)
    assert m.feed("oh hello").text == "oh hel"
    m = StopStringMatcher(["b", "ab"])
    assert m.feed("xab").text == "x"  # "ab" starts first


def _state(tok: Tokenizer, **opts: object) -> CompletionState:
    return CompletionState(0, tok, [], TextOptions(**opts))  # type: ignore[arg-type]


def _run(state: CompletionState, ids: list[int], finish: FinishReason | None = None) -> tuple[str, FinishReason | None, int]:
    text = ""
    for i, t in enumerate(ids):
        reason = finish if i == len(ids) - 1 else None
        chunk = state.process(EngineOutput("r", 0, [t], [-0.5], finish_reason=reason))
        if chunk is None:
            break
        text += chunk.text
        if chunk.finish_reason is not None:
            return text, chunk.finish_reason, chunk.generated_tokens
    return text, None, state.generated_tokens


def test_stop_sequence_split_across_tokens_is_trimmed(tok: Tokenizer) -> None:
    ids = tok.encode("The answer is 42. Done here", add_special_tokens=False)
    text, reason, generated = _run(_state(tok, stop_sequences=("2. Do",)), ids, FinishReason.LENGTH)
    assert (text, reason) == ("The answer is 4", FinishReason.STOP_SEQUENCE)
    assert generated < len(ids)
    text, _, _ = _run(_state(tok, stop_sequences=("2. Do",), include_stop_sequence=True), ids, FinishReason.LENGTH)
    assert text == "The answer is 42. Do"


def test_stop_sequence_ignored_before_min_new_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("a b a b a b", add_special_tokens=False)
    text, reason, generated = _run(_state(tok, stop_sequences=(" b",), min_new_tokens=3), ids, FinishReason.LENGTH)
    assert reason is FinishReason.STOP_SEQUENCE and generated >= 3
    assert text == "a b a"


def test_eos_text_is_never_in_the_completion(tok: Tokenizer) -> None:
    ids = [*tok.encode("Paris.", add_special_tokens=False), 2]
    text, reason, generated = _run(_state(tok), ids, FinishReason.EOS_TOKEN)
    assert (text, reason, generated) == ("Paris.", FinishReason.EOS_TOKEN, len(ids))


def test_stop_token_text_kept_only_with_include(tok: Tokenizer) -> None:
    ids = tok.encode("Paris.", add_special_tokens=False)
    text, reason, _ = _run(_state(tok), ids, FinishReason.STOP_SEQUENCE)
    assert (text, reason) == ("Paris", FinishReason.STOP_SEQUENCE)
    text, _, _ = _run(_state(tok, include_stop_sequence=True), ids, FinishReason.STOP_SEQUENCE)
    assert text == "Paris."


def test_time_limit_flushes_held_text(tok: Tokenizer) -> None:
    state = _state(tok, stop_sequences=("XYZ",))
    ids = tok.encode("abc X", add_special_tokens=False)
    text, _, _ = _run(state, ids)
    chunk = state.finish(FinishReason.TIME_LIMIT)
    assert chunk is not None and chunk.finish_reason is FinishReason.TIME_LIMIT
    assert text + chunk.text == "abc X"
