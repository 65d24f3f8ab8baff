"""tests/helpers/call_counter.py: the counter counts calls through to the original, and the
original comes back after the test."""

from __future__ import annotations

import types

import pytest
from helpers.call_counter import CallCounter


def test_counts_calls_and_returns_what_the_original_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    owner = types.SimpleNamespace(double=lambda x, scale=2: x * scale)
    original = owner.double
    counter = CallCounter(monkeypatch, owner, "double")
    assert counter.calls == 0
    assert owner.double(3) == 6 and owner.double(3, scale=5) == 15
    assert counter.calls == 2
    counter.calls = 0
    owner.double(1)
    assert counter.calls == 1
    monkeypatch.undo()
    assert owner.double is original
