"""Progress of the slow steps of a first start: converting a GGUF file, compiling a CPU kernel.

A :class:`ProgressReporter` says what its step does and how long it usually takes when the step
starts, then logs one structured line every ``interval_s`` seconds while it runs (its phase, the
items done of the phase's total, the seconds so far), and one when it ends (its duration). A step
that is usually fast but sometimes slow (loading a CPU kernel that may have to be compiled) says
so only once it has run ``announce_after_s`` seconds, and then reports as above. The
phases that count items (tensors) show a tqdm bar instead of those periodic lines when the log
goes to a terminal as text (:func:`loom.logging_setup.progress_bars_enabled`); a JSON log or a
file never gets a bar, so every line of it stays one JSON object.

``LOOM_PROGRESS_INTERVAL_S`` sets the interval (default 5 s).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sized
from types import TracebackType
from typing import Any, TypeVar

import structlog

from loom.logging_setup import progress_bars_enabled

log = structlog.get_logger(__name__)

T = TypeVar("T")

DEFAULT_INTERVAL_S = 5.0


def progress_interval_s() -> float:
    """Seconds between two progress lines: ``LOOM_PROGRESS_INTERVAL_S``, else 5."""
    raw = os.environ.get("LOOM_PROGRESS_INTERVAL_S")
    try:
        value = float(raw) if raw else DEFAULT_INTERVAL_S
    except ValueError:
        return DEFAULT_INTERVAL_S
    return value if value > 0 else DEFAULT_INTERVAL_S


class ProgressReporter:
    """One slow step, reporting itself while it runs (see the module docstring).

    ``what`` names the step ("converting the GGUF file into the cache"); ``usual_s`` is how long
    it usually takes (measured on the 2-core development machine), quoted in the first line;
    ``fields`` go into every line; ``announce_after_s``: say nothing unless the step is still
    running after this long. Use it as a context manager around the step.
    """

    def __init__(self, what: str, usual_s: float | None = None, *, logger: Any = None,
                 interval_s: float | None = None, announce_after_s: float = 0.0, **fields: Any) -> None:
        self.what, self.usual_s, self.fields = what, usual_s, fields
        self.interval_s = interval_s if interval_s is not None else progress_interval_s()
        self.announce_after_s = announce_after_s
        self._announced = False
        self._log = logger if logger is not None else log
        self._state: tuple[str | None, int, int | None] = (None, 0, None)  # phase, done, total
        self._bar_active = False
        self._started = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what the step calls --------------------------------------------------------------------
    def phase(self, name: str, total: int | None = None) -> None:
        """A new phase; ``total``: the items it counts, if it counts any."""
        self._state = (name, 0, total)

    def advance(self, n: int = 1) -> None:
        name, done, total = self._state
        self._state = (name, done + n, total)

    def track(self, items: Iterable[T], phase: str, total: int | None = None) -> Iterator[T]:
        """Iterate ``items`` as phase ``phase``, one item counted each; a bar on a text terminal."""
        if total is None and isinstance(items, Sized):
            total = len(items)
        self.phase(phase, total)
        if not progress_bars_enabled():
            for item in items:
                yield item
                self.advance()
            return
        from tqdm import tqdm

        self._bar_active = True
        try:
            for item in tqdm(items, desc=phase, total=total, leave=False, file=sys.stderr):
                yield item
                self.advance()
        finally:
            self._bar_active = False

    def elapsed_s(self) -> float:
        return time.monotonic() - self._started

    # -- the lines ------------------------------------------------------------------------------
    def _announce(self) -> None:
        usual = f" (usually about {self.usual_s:.0f} s on 2 cores)" if self.usual_s is not None else ""
        self._log.info(f"{self.what}{usual}", usual_s=self.usual_s, **self.fields)
        self._announced = True

    def _heartbeat(self) -> None:
        if self.announce_after_s > 0:
            if self._stop.wait(self.announce_after_s):
                return  # done before it was worth a line
            self._announce()
        while not self._stop.wait(self.interval_s):
            if self._bar_active:  # the bar shows it already
                continue
            name, done, total = self._state
            where: dict[str, Any] = {} if name is None else {"phase": name}
            if total is not None:
                where.update(done=done, total=total)
            self._log.info(f"{self.what}: still running", elapsed_s=round(self.elapsed_s(), 1), **where,
                           **self.fields)

    def __enter__(self) -> ProgressReporter:
        self._started = time.monotonic()
        if self.announce_after_s <= 0:
            self._announce()
        self._thread = threading.Thread(target=self._heartbeat, name="loom-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if not self._announced:
            return  # a quick step; a failure is the caller's to report
        duration = round(self.elapsed_s(), 1)
        if exc is None:
            self._log.info(f"{self.what}: done", duration_s=duration, **self.fields)
        else:
            self._log.warning(f"{self.what}: failed", duration_s=duration, error=repr(exc), **self.fields)
