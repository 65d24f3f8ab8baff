"""On a real GPU, the grammar process's shared bitmask rows are page-locked for the device
(``loom.worker.staging.HostRegistration``) and copied to it straight from where the child wrote
them: the constrained tokens equal those of the driver in the engine's process (synchronous
scheduling, rows staged through a host copy), with the rows registered and not
(``LOOM_GRAMMAR_ROWS_REGISTERED=0``), and with the next step's inputs staged before the engine
waits for the rows (``LOOM_STAGE_BEFORE_ROWS=1``: pinned staging buffers and CUDA graphs), and with
two grammar processes writing their rows into one registered mapping (``grammar_processes=2``),
and with the stream waiting for the rows instead of the engine (``LOOM_GRAMMAR_DEVICE_WAIT=1``:
``cuStreamWaitValue32`` on the shared fill flag; the sampling is queued before the child has
written the rows).

A tiny Llama in float32 with SmolLM2's vocabulary: no near-ties, so equality is exact.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("xgrammar")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"},
    "n": {"type": "integer", "minimum": 0, "maximum": 9},
    "color": {"enum": ["red", "green"]},
}, "required": ["ok", "n", "color"]}


def _requests() -> list[Any]:
    from helpers.structured_engine import request

    from loom.structured.grammars import choice_to_ebnf
    from loom.structured.spec import GrammarSpec

    json_spec = GrammarSpec("json_schema", json.dumps(SCHEMA), "parameters.constraint.json_schema")
    regex = GrammarSpec("regex", "(ab|ba|a|b){20,40}", "parameters.constraint.regex")
    choice = GrammarSpec("ebnf", choice_to_ebnf(["yes", "no", "maybe"]), "parameters.constraint.choice")
    reqs = [request(f"json{i}", json_spec, new=40 + i) for i in range(6)]
    reqs += [request(f"regex{i}", regex, new=30 + i) for i in range(6)]
    reqs += [request("choice", choice), request("plain", None, new=40)]
    return reqs


def _engine(model_dir: Path, **overrides: Any) -> Any:
    from loom.config import EngineConfig
    from loom.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model_id=str(model_dir), device="cuda", dtype="float32",
                                  max_batch_total_tokens=8192, warmup=False, **overrides))


@pytest.fixture(scope="module")
def want(tiny_llama_dir: Path) -> Iterator[dict[tuple[str, int], list[int]]]:
    from helpers.structured_engine import ids, run

    reference = _engine(tiny_llama_dir, async_scheduling="off", grammar_process="off")
    try:
        yield {k: ids(v) for k, v in run(reference, _requests()).items()}
    finally:
        reference.close()


@pytest.mark.parametrize(("registered", "stage_before_rows", "processes"),
                         [(True, False, 1), (False, False, 1), (True, True, 1), (True, True, 2)])
def test_rows_copied_from_the_shared_memory_give_the_drivers_tokens(
        tiny_llama_dir: Path, want: dict[tuple[str, int], list[int]], monkeypatch: pytest.MonkeyPatch,
        registered: bool, stage_before_rows: bool, processes: int) -> None:
    from helpers.call_counter import CallCounter
    from helpers.structured_engine import ids, run

    from loom import kernel_switches
    from loom.structured.grammar_group import GrammarProcessGroup
    from loom.structured.grammar_process import GrammarProcess

    monkeypatch.setattr(kernel_switches, "grammar_rows_registered", registered)
    monkeypatch.setattr(kernel_switches, "stage_before_rows", stage_before_rows)
    engine = _engine(tiny_llama_dir, async_scheduling="on", grammar_process="on", grammar_processes=processes)
    staged = CallCounter(monkeypatch, engine.worker, "stage_forward")
    try:
        got = {k: ids(v) for k, v in run(engine, _requests()).items()}
        assert (staged.calls > 20) == stage_before_rows
        process = engine._structured
        assert isinstance(process, GrammarProcess if processes == 1 else GrammarProcessGroup)
        assert process._rows.registered == registered
        if registered:
            assert process._rows.views[0].is_pinned() and process._rows.views[1].is_pinned()
        assert process.waits.fills > 20 and engine.num_async_steps > 20
    finally:
        engine.close()
    assert got == want


def test_the_stream_waits_for_a_host_word() -> None:
    """loom.worker.stream_wait: the probe passes on this GPU, and a stream queued behind a wait runs
    only once the registered word reaches the value (a later value releases it too)."""
    import time

    from loom.worker import stream_wait
    from loom.worker.staging import HostRegistration

    assert stream_wait.available(torch.cuda.current_device())
    word = torch.zeros(1024, dtype=torch.int32)
    reg = HostRegistration.of(word)
    assert reg is not None
    try:
        stream = torch.cuda.Stream()
        out = torch.zeros(1, device="cuda")
        stream_wait.wait_value(stream, stream_wait.device_pointer(word.data_ptr()), 7)
        with torch.cuda.stream(stream):
            out.fill_(1.0)
        done = torch.cuda.Event()
        done.record(stream)
        time.sleep(0.05)
        assert not done.query() and float(out.cpu()) == 0.0  # (the default stream: not held)
        word[0] = 8
        done.synchronize()
        assert float(out.cpu()) == 1.0
    finally:
        word[0] = 1 << 20
        reg.release()


def test_the_stream_waiting_for_the_rows_gives_the_drivers_tokens(
        tiny_llama_dir: Path, want: dict[tuple[str, int], list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """LOOM_GRAMMAR_DEVICE_WAIT: every constrained step's rows went to the sampling unwaited (the
    stream waited for the child's flag), and the tokens are the driver's."""
    from helpers.call_counter import CallCounter
    from helpers.structured_engine import ids, run

    from loom import kernel_switches
    from loom.structured.grammar_process import GrammarProcess

    monkeypatch.setattr(kernel_switches, "grammar_device_wait", True)
    unwaited = CallCounter(monkeypatch, GrammarProcess, "_unwaited_rows")
    engine = _engine(tiny_llama_dir, async_scheduling="on", grammar_process="on")
    try:
        got = {k: ids(v) for k, v in run(engine, _requests()).items()}
        process = engine._structured
        assert isinstance(process, GrammarProcess) and process.device_wait and process._rows.registered
        assert unwaited.calls > 20 and engine.num_async_steps > 20
    finally:
        engine.close()
    assert got == want
