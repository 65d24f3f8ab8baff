"""structlog configuration: console or JSON lines, with contextvars (request_id) merged in.

Progress bars (tqdm) belong on a terminal only: with ``--json-output``, or when stderr is not a
terminal, transformers' and huggingface_hub's own bars are turned off, in this process and, through
``HF_HUB_DISABLE_PROGRESS_BARS``, in the processes it starts (the engine is spawned and
configures itself the same way). Loom's own (see :mod:`loom.startup_progress`) ask
:func:`progress_bars_enabled`.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

_progress_bars: bool | None = None  # None: not configured; bars when stderr is a terminal
_settings: tuple[bool, str] = (False, "INFO")  # (json_output, level) of the last configure_logging


def progress_bars_enabled() -> bool:
    """Whether a tqdm bar may be drawn: text logs (not JSON) to a terminal."""
    if _progress_bars is None:
        return sys.stderr.isatty()
    return _progress_bars


def _disable_library_progress_bars() -> None:
    # Read by huggingface_hub when it is imported (transformers follows it), here and in children.
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


def logging_settings() -> tuple[bool, str]:
    """``(json_output, level)`` as this process configured them: a helper process it starts logs alike."""
    return _settings


def configure_logging(json_output: bool = False, level: str = "INFO", process: str = "server") -> None:
    global _progress_bars, _settings
    _settings = (json_output, level)

    def add_process(logger: object, method: str, event_dict: structlog.types.EventDict) -> structlog.types.EventDict:
        # Not only a contextvar: threads (a kernel compiling in the background) start without one.
        event_dict.setdefault("process", process)
        return event_dict

    processors: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        add_process,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if json_output:
        processors += [structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()]
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(process=process)
    _progress_bars = not json_output and sys.stderr.isatty()
    if not _progress_bars:
        _disable_library_progress_bars()
