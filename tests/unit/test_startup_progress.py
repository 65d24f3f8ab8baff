"""Progress of the slow start-up steps: the reporter's lines, bars only on a text terminal,
transformers' own bars folded into the count, a kernel compile announced and reported."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from loom import cpu_extension, logging_setup, startup_progress
from loom.startup_progress import ProgressReporter


class Recorder:
    """Stands in for a structlog logger: (level, event, fields) of every line."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append(("info", event, fields))

    def warning(self, event: str, **fields: Any) -> None:
        self.lines.append(("warning", event, fields))

    def debug(self, event: str, **fields: Any) -> None:
        self.lines.append(("debug", event, fields))

    def events(self) -> list[str]:
        return [event for _, event, _ in self.lines]

    def still_running(self) -> list[dict[str, Any]]:
        return [fields for _, event, fields in self.lines if event.endswith("still running")]


def _wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def no_bars(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logging_setup, "_progress_bars", False)


def test_a_step_says_what_and_how_long_then_reports_phase_and_counts(no_bars: None) -> None:
    rec = Recorder()
    with ProgressReporter("converting the thing", 30, logger=rec, interval_s=0.02, model="m") as progress:
        progress.phase("reading")
        _wait_for(lambda: any(f["phase"] == "reading" for f in rec.still_running()))
        items = iter(progress.track(list(range(10)), "dequantizing tensors"))
        for _ in range(3):
            next(items)
        next(items)  # the 4th item is handed out once the 3rd is counted
        _wait_for(lambda: any(f.get("done") == 3 for f in rec.still_running()))
    _, first, first_fields = rec.lines[0]
    assert first == "converting the thing (usually about 30 s on 2 cores)"
    assert first_fields == {"usual_s": 30, "model": "m"}
    reading = next(f for f in rec.still_running() if f["phase"] == "reading")
    assert "done" not in reading and reading["model"] == "m" and reading["elapsed_s"] >= 0
    counted = next(f for f in rec.still_running() if f.get("done") == 3)
    assert counted["phase"] == "dequantizing tensors" and counted["total"] == 10
    level, last, fields = rec.lines[-1]
    assert last == "converting the thing: done" and fields["duration_s"] >= 0 and level == "info"
    n = len(rec.lines)
    time.sleep(0.1)
    assert len(rec.lines) == n  # the heartbeat stopped with the step


def test_a_failed_step_says_so(no_bars: None) -> None:
    rec = Recorder()
    with pytest.raises(RuntimeError), ProgressReporter("converting", 30, logger=rec, interval_s=10):
        raise RuntimeError("bad file")
    level, event, fields = rec.lines[-1]
    assert (level, event) == ("warning", "converting: failed") and "bad file" in fields["error"]


def test_a_usually_quick_step_is_announced_only_when_it_is_slow(no_bars: None) -> None:
    rec = Recorder()
    with ProgressReporter("compiling", 12, logger=rec, interval_s=0.02, announce_after_s=5):
        pass
    assert rec.lines == []
    with ProgressReporter("compiling", 12, logger=rec, interval_s=0.02, announce_after_s=0.05):
        _wait_for(lambda: len(rec.still_running()) >= 1)
    assert rec.events()[0] == "compiling (usually about 12 s on 2 cores)"
    assert rec.events()[-1] == "compiling: done"


def test_bars_only_on_a_text_terminal(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    import os

    from transformers.utils import logging as transformers_logging

    saved, bars_were_on = structlog.get_config(), transformers_logging.is_progress_bar_enabled()
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    monkeypatch.setattr(logging_setup, "_progress_bars", None)
    try:
        monkeypatch.setattr("sys.stderr.isatty", lambda: True)
        logging_setup.configure_logging(json_output=False)
        assert logging_setup.progress_bars_enabled()
        logging_setup.configure_logging(json_output=True)
        assert not logging_setup.progress_bars_enabled()
        assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"  # inherited by the spawned engine
        assert not transformers_logging.is_progress_bar_enabled()
        monkeypatch.setattr("sys.stderr.isatty", lambda: False)
        logging_setup.configure_logging(json_output=False)
        assert not logging_setup.progress_bars_enabled()  # text, but to a file or a pipe
    finally:
        structlog.configure(**saved)
        if bars_were_on:
            transformers_logging.enable_progress_bar()
    rec = Recorder()
    capfd.readouterr()
    with ProgressReporter("converting", 30, logger=rec, interval_s=10) as progress:
        assert list(progress.track(range(5), "tensors")) == list(range(5))
    assert capfd.readouterr().err == ""  # no bar: not a text terminal
    monkeypatch.setattr(logging_setup, "_progress_bars", True)
    with ProgressReporter("converting", 30, logger=rec, interval_s=0.01) as progress:
        for _ in progress.track(range(5), "tensors"):
            time.sleep(0.03)
    err = capfd.readouterr().err
    assert "tensors:" in err and "0/5 [" in err  # the bar (cleared at the end: leave=False)
    assert rec.still_running() == []  # the bar replaces the periodic lines while it runs


def test_transformers_bars_become_the_reporters_count(no_bars: None, capfd: pytest.CaptureFixture[str]) -> None:
    from transformers import modeling_gguf_pytorch_utils
    from transformers.utils import logging as transformers_logging

    from loom.model_loader.transformers_progress import report_transformers_progress

    rec = Recorder()
    seen: list[tuple[str | None, int, int | None]] = []
    capfd.readouterr()
    progress = ProgressReporter("converting", 30, logger=rec, interval_s=10)
    with progress, report_transformers_progress(progress):
        for _ in modeling_gguf_pytorch_utils.tqdm(list(range(6)), desc="Converting and de-quantizing GGUF tensors..."):
            pass
        seen.append(progress._state)
        for _ in transformers_logging.tqdm({"a": 1, "b": 2}.items(), desc="Loading weights"):
            pass
        seen.append(progress._state)
    assert seen == [("Converting and de-quantizing GGUF tensors", 6, 6), ("Loading weights", 2, 2)]
    # outside a conversion, with bars off, transformers' GGUF loop draws nothing either
    assert list(modeling_gguf_pytorch_utils.tqdm(range(3), desc="Converting")) == [0, 1, 2]
    assert capfd.readouterr().err == ""


@pytest.fixture
def fake_build(monkeypatch: pytest.MonkeyPatch) -> Iterator[Recorder]:
    rec = Recorder()
    monkeypatch.setattr(startup_progress, "log", rec)
    monkeypatch.setattr(cpu_extension, "_COMPILE_ANNOUNCE_AFTER_S", 0.05)
    monkeypatch.setenv("LOOM_PROGRESS_INTERVAL_S", "0.05")
    monkeypatch.setenv("LOOM_CPU_KERNELS", "1")
    yield rec


def test_a_kernel_compile_is_announced_and_reported(fake_build: Recorder, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", lambda **kw: time.sleep(0.4))  # a compile
    ext = cpu_extension.CpuExtension("loom_test_slow", tmp_path / "k.cpp", namespace="loom_test_slow", op="f",
                                     usual_build_s=12)
    assert not ext.available()  # the fake registers no operator
    events = fake_build.events()
    assert events[0] == "compiling a CPU kernel, once per machine (usually about 12 s on 2 cores)"
    assert fake_build.still_running() and fake_build.still_running()[0]["kernel"] == "loom_test_slow"
    assert events[-1].endswith(": done")


def test_a_cached_kernel_loads_without_a_line(fake_build: Recorder, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", lambda **kw: None)  # from the cache: milliseconds
    ext = cpu_extension.CpuExtension("loom_test_fast", tmp_path / "k.cpp", namespace="loom_test_fast", op="f",
                                     usual_build_s=12)
    ext.available()
    assert fake_build.lines == []
