"""The one-way pipe, enforced: the engine, the layers, the model loader, the plugin API and the
built-in plugins never import the gRPC front end (grpc, loom.server, loom.frontend, the client's
stubs). A tensor-parallel worker process can then import them without a server, and a
third-party plugin sees only what a plugin needs."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENGINE_SIDE = ["service/loom/engine", "service/loom/worker", "service/loom/sample", "service/loom/layers", "service/loom/model_loader",
               "service/loom/distributed", "service/loom/structured",
               "service/loom/plugin_api", "plugins"]
FORBIDDEN = ("grpc", "grpc_health", "grpc_reflection", "grpc_status", "loom.server", "loom.frontend",
             "loom_client", "google.rpc")


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def _files() -> list[Path]:
    return sorted(p for d in ENGINE_SIDE for p in (ROOT / d).rglob("*.py") if "fixtures" not in p.parts)


def test_the_engine_side_never_imports_the_front_end() -> None:
    files = _files()
    assert len(files) > 30  # the walk found the tree
    bad = [f"{p.relative_to(ROOT)}:{line} imports {name}" for p in files for line, name in _imports(p)
           if any(name == f or name.startswith(f + ".") for f in FORBIDDEN)]
    assert not bad, "\n".join(bad)


def test_the_check_itself_catches_a_forbidden_import(tmp_path: Path) -> None:
    sample = tmp_path / "m.py"
    sample.write_text("import os\nfrom loom.server.errors import internal\nimport grpc.aio as g\n")
    names = [name for _, name in _imports(sample)]
    assert [n for n in names if any(n == f or n.startswith(f + ".") for f in FORBIDDEN)] == [
        "loom.server.errors", "grpc.aio"]


@pytest.mark.parametrize("message", [
    "AddRequest", "AbortRequest", "AbortCompletion", "StatsQuery", "Shutdown",
    "EngineReady", "EngineFailed", "StepOutputs", "StatsReply",
])
def test_pipe_messages_are_typed_and_survive_pickling(message: str) -> None:
    from loom.engine import types as t
    from loom.structured.spec import GrammarSpec

    examples = {
        "AddRequest": t.AddRequest(t.EngineRequest("r", (1, 2, 3), t.SamplingParams(
            do_sample=True, seed=3, constraint=GrammarSpec("json_schema", '{"type": "integer"}', "f")))),
        "AbortRequest": t.AbortRequest("r"),
        "AbortCompletion": t.AbortCompletion("r", 1),
        "StatsQuery": t.StatsQuery(),
        "Shutdown": t.Shutdown(),
        "EngineReady": t.EngineReady(t.EngineInfo("m", "llama", "float32", "cpu", "torch", 16, 4, 64, 64, 320, (2,))),
        "EngineFailed": t.EngineFailed("--quantize x: unknown"),
        "StepOutputs": t.StepOutputs([t.EngineOutput("r", 0, [5], [-0.5], finish_reason=t.FinishReason.LENGTH),
                                      t.EngineOutput("q", 0, [], [], finish_reason=t.FinishReason.ERROR, error="slow",
                                                     rejection=t.Rejection("INVALID_ARGUMENT", "f", "R"))]),
        "StatsReply": t.StatsReply(t.EngineStats(0, 0, 4, 4, 0, 0, grammar_compile_buckets=(1, 0))),
    }
    msg = examples[message]
    assert type(msg).__name__ == message
    assert pickle.loads(pickle.dumps(msg)) == msg


WORKER_SIDE = ["service/loom/worker", "service/loom/sample", "service/loom/layers", "plugins"]


def test_the_worker_side_never_imports_the_engine_core() -> None:
    """The worker (one per rank, later in its own process) sees step plans, not the scheduler's
    sequences: nothing under worker/, sample/, layers/ or the plugins imports loom.engine."""
    files = sorted(p for d in WORKER_SIDE for p in (ROOT / d).rglob("*.py") if "fixtures" not in p.parts)
    assert len(files) > 20
    bad = [f"{p.relative_to(ROOT)}:{line} imports {name}" for p in files for line, name in _imports(p)
           if name == "loom.engine" or name.startswith("loom.engine.")]
    assert not bad, "\n".join(bad)


def _holds_a_sequence(obj: object, seen: set[int]) -> bool:
    from dataclasses import fields, is_dataclass

    from loom.engine.sequence import Sequence

    if id(obj) in seen:
        return False
    seen.add(id(obj))
    if isinstance(obj, Sequence):
        return True
    if is_dataclass(obj) and not isinstance(obj, type):
        return any(_holds_a_sequence(getattr(obj, f.name), seen) for f in fields(obj))
    if isinstance(obj, (list, tuple, set)):
        return any(_holds_a_sequence(x, seen) for x in obj)
    if isinstance(obj, dict):
        return any(_holds_a_sequence(k, seen) or _holds_a_sequence(v, seen) for k, v in obj.items())
    return False


def test_step_plans_hold_no_sequence_and_survive_pickling(make_engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every plan of a busy run (prefill chunks, prompt logprobs, penalties, n > 1 forks, decode)
    is plain data: pickled and read back it equals itself, and so does the worker's answer."""
    from loom.engine.types import EngineRequest, SamplingParams, StoppingParams

    engine = make_engine(max_batch_prefill_tokens=8)
    plans, results = [], []
    execute, finish = engine.worker.execute, engine.worker.finish

    def recording_execute(plan: Any) -> Any:
        plans.append(plan)
        return execute(plan)

    def recording_finish(step: Any) -> Any:
        out = finish(step)
        results.append(out)
        return out

    monkeypatch.setattr(engine.worker, "execute", recording_execute)
    monkeypatch.setattr(engine.worker, "finish", recording_finish)
    engine.add_request(EngineRequest("long", tuple(range(5, 25)), SamplingParams(prompt_logprobs=True, top_n_tokens=2),
                                     StoppingParams(max_new_tokens=3, ignore_eos=True)))
    engine.add_request(EngineRequest("pen", (5, 6, 7), SamplingParams(do_sample=True, seed=1, repetition_penalty=1.3,
                                                                      frequency_penalty=0.2, min_p=0.05),
                                     StoppingParams(max_new_tokens=3, min_new_tokens=2, ignore_eos=True), n=2))
    while engine.has_unfinished():
        engine.step()
    assert any(p.prompt_logprobs for p in plans) and any(p.sampling.seen_token_ids for p in plans)
    assert any(len(p.sample_seq_ids) > len(p.query_lens) for p in plans)  # a fork samples from its parent's row
    for obj in [*plans, *results]:
        assert not _holds_a_sequence(obj, set())
        assert pickle.loads(pickle.dumps(obj)) == obj
