"""On a real GPU, the grammar process's shared bitmask rows are page-locked for the device
(``loom.worker.staging.HostRegistration``) and copied to it straight from where the child wrote
them: the constrained tokens equal those of the driver in the engine's process (synchronous
scheduling, rows staged through a host copy), with the rows registered and not
(``LOOM_GRAMMAR_ROWS_REGISTERED=0``), and with the next step's inputs staged before the engine
waits for the rows (``LOOM_STAGE_BEFORE_ROWS=1``: pinned staging buffers and CUDA graphs), and with
two grammar processes writing their rows into one registered mapping (``grammar_processes=2``).

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
