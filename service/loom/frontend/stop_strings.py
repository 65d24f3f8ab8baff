"""Stop sequences matched on the decoded text, across token boundaries.

Text is fed in as the detokenizer releases it. Whatever could still be the start of a stop
sequence is held back rather than streamed, so a client never receives text that later turns
out to be part of a stop sequence. On a match the completion's text ends just before it, or
just after it with ``include_stop_sequence``; everything after is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopResult:
    text: str  # text safe to emit now
    matched: str | None = None  # the stop sequence that ended the completion


class StopStringMatcher:
    def __init__(self, stop_sequences: Sequence[str], include_stop_sequence: bool = False) -> None:
        self._stops = tuple(s for s in stop_sequences if s)
        self._include = include_stop_sequence
        self._held = ""
        self._longest = max((len(s) for s in self._stops), default=0)
        self.matched: str | None = None

    @property
    def held(self) -> str:
        return self._held

    def feed(self, text: str, active: bool = True) -> StopResult:
        """Add newly decoded text. ``active=False`` (before min_new_tokens) passes it through."""
        if self.matched is not None:
            return StopResult("", self.matched)
        if not self._stops or not active:
            out, self._held = self._held + text, ""
            return StopResult(out)
        buf = self._held + text
        # Earliest match wins; at the same position, the longest stop sequence.
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            pos = buf.find(stop)
            if pos >= 0 and (best is None or (pos, -len(stop)) < (best[0], -best[1])):
                best = (pos, len(stop), stop)
        if best is not None:
            pos, length, stop = best
            self.matched = stop
            self._held = ""
            return StopResult(buf[: pos + length] if self._include else buf[:pos], stop)
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return StopResult(buf[: len(buf) - keep])

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop sequence."""
        for length in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-length:]
            if any(s.startswith(tail) for s in self._stops):
                return length
        return 0

    def flush(self) -> str:
        """The held-back text, released when the completion ends for another reason."""
        out, self._held = self._held, ""
        return out if self.matched is None else ""
