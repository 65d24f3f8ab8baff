"""transformers' progress bars during a GGUF conversion, turned into a :class:`ProgressReporter`'s count.

transformers draws two bars while it loads a GGUF file: its per-tensor dequantization loop
(``modeling_gguf_pytorch_utils``, which calls ``tqdm.auto`` directly, so
``disable_progress_bar()`` does not reach it) and "Loading weights" (through
``transformers.utils.logging.tqdm``, which has a hook). Both are routed here: inside
:func:`report_transformers_progress` each such loop becomes a phase of the reporter (its items
counted, a bar only where the reporter draws one); outside it the GGUF loop draws a bar only where
:func:`loom.logging_setup.progress_bars_enabled` allows one. Nothing then writes a tqdm line into a
JSON log.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sized
from contextvars import ContextVar
from typing import Any

from loom.logging_setup import progress_bars_enabled
from loom.startup_progress import ProgressReporter

_current: ContextVar[ProgressReporter | None] = ContextVar("loom_conversion_progress", default=None)
_install_lock = threading.Lock()
_installed = False


class _CountedLoop:
    """What a tqdm call returns: iterates its items, counting each in the reporter (or, without a
    reporter, silently); the other tqdm methods a caller may use do nothing."""

    def __init__(self, items: Iterable[Any] | None, progress: ProgressReporter | None, desc: str,
                 total: int | None) -> None:
        self._items = items if items is not None else ()
        self._progress, self._desc, self._total = progress, desc, total

    def __iter__(self) -> Iterator[Any]:
        if self._progress is None:
            return iter(self._items)
        return self._progress.track(self._items, self._desc, self._total)

    def __len__(self) -> int:
        return self._total if self._total is not None else len(self._items)  # type: ignore[arg-type]

    def update(self, n: int = 1) -> None:
        if self._progress is not None:
            self._progress.advance(n)

    def __enter__(self) -> _CountedLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def __getattr__(self, name: str) -> Callable[..., None]:  # close, set_description, refresh...
        return lambda *args, **kwargs: None


def _loop(factory: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    progress = _current.get()
    if progress is None and progress_bars_enabled():
        return factory(*args, **kwargs)
    items = args[0] if args else kwargs.get("iterable")
    desc = str(kwargs.get("desc") or "working").rstrip(". ")
    total = kwargs.get("total")
    if total is None and isinstance(items, Sized):
        total = len(items)
    return _CountedLoop(items, progress, desc, total)


def _install() -> None:
    """Route both bars through :func:`_loop`, once per process (it falls back to a plain bar, or
    to none, when no conversion is being reported)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        from transformers import modeling_gguf_pytorch_utils
        from transformers.utils import logging as transformers_logging

        gguf_tqdm = getattr(modeling_gguf_pytorch_utils, "tqdm", None)
        if gguf_tqdm is not None:
            modeling_gguf_pytorch_utils.tqdm = lambda *a, **kw: _loop(gguf_tqdm, a, kw)
        set_hook = getattr(transformers_logging, "set_tqdm_hook", None)  # transformers >= 5
        if set_hook is not None:
            previous: Callable[..., Any] | None = None

            def hook(factory: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                if _current.get() is None and previous is not None:
                    return previous(factory, args, kwargs)
                return _loop(factory, args, kwargs)

            previous = set_hook(hook)
        _installed = True


@contextlib.contextmanager
def report_transformers_progress(progress: ProgressReporter) -> Iterator[None]:
    """While inside, transformers' loading loops are phases of ``progress`` (in this thread)."""
    _install()
    token = _current.set(progress)
    try:
        yield
    finally:
        _current.reset(token)
