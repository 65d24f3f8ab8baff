"""Grammar matchers that raise, for the structured-output driver's fault isolation.

:class:`BrokenMatchers` breaks chosen matchers of a :class:`~loom.structured.driver.StructuredOutput`:
their own ``fill_next_token_bitmask`` / ``accept_token`` raise, and xgrammar's batch calls
(patched on ``xgrammar.base._core.BatchGrammarMatcher`` while the test runs) raise when they reach
such a matcher's handle, after doing the rows before it, as xgrammar's own loop does (the fill
and accept loops of ``BatchGrammarMatcher`` go row by row and stop at the row that raises).
Every other call goes to the real xgrammar."""

from __future__ import annotations

from typing import Any

import pytest


class Broken:
    """A real matcher whose ``fill_next_token_bitmask`` and/or ``accept_token`` raise."""

    def __init__(self, real: Any, fill: bool, accept: bool) -> None:
        self._real, self._fill, self._accept = real, fill, accept

    def __getattr__(self, name: str) -> Any:  # _handle, fork, rollback, is_terminated...
        return getattr(self._real, name)

    def fill_next_token_bitmask(self, bitmask: Any, index: int = 0) -> bool:
        if self._fill:
            raise RuntimeError("injected: the matcher's fill failed")
        return bool(self._real.fill_next_token_bitmask(bitmask, index))

    def accept_token(self, token: int) -> bool:
        if self._accept:
            raise RuntimeError("injected: the matcher's accept failed")
        return bool(self._real.accept_token(token))


class BrokenMatchers:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from xgrammar.base import _core

        self.fill: set[int] = set()  # id() of the handles whose fill raises
        self.accept: set[int] = set()  # ... whose accept raises
        self.batch_fills = self.batch_accepts = 0  # batch calls that raised
        cls = _core.BatchGrammarMatcher
        real_fill, real_accept = cls.batch_fill_next_token_bitmask, cls.batch_accept_token

        def batch_fill(batcher: Any, handles: list[Any], bitmask: Any, indices: list[int] | None,
                       debug: bool) -> None:
            if not any(id(h) in self.fill for h in handles):
                return real_fill(batcher, handles, bitmask, indices, debug)
            for h, g in zip(handles, range(len(handles)) if indices is None else indices, strict=True):
                if id(h) in self.fill:
                    self.batch_fills += 1
                    raise RuntimeError("injected: a batch fill failed")
                real_fill(batcher, [h], bitmask, [g], debug)
            return None

        def batch_accept(handles: list[Any], tokens: list[int], debug: bool) -> Any:
            if not any(id(h) in self.accept for h in handles):
                return real_accept(handles, tokens, debug)
            for h, t in zip(handles, tokens, strict=True):
                if id(h) in self.accept:
                    self.batch_accepts += 1
                    raise RuntimeError("injected: a batch accept failed")
                real_accept([h], [t], debug)  # the rows before it are done
            raise AssertionError("unreachable")

        monkeypatch.setattr(cls, "batch_fill_next_token_bitmask", batch_fill)
        monkeypatch.setattr(cls, "batch_accept_token", staticmethod(batch_accept))

    def break_(self, driver: Any, seq: Any, fill: bool = False, accept: bool = False) -> None:
        """Make ``seq``'s matcher in ``driver`` raise on fill and/or accept, alone and in batches."""
        entry = driver._matchers[seq.seq_id]
        entry.matcher = Broken(entry.matcher, fill, accept)
        if fill:
            self.fill.add(id(entry.handle))
        if accept:
            self.accept.add(id(entry.handle))
