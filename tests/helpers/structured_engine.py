"""Stepping the in-process engine with constrained requests: the request shape, the step loop and
the checks that tests/unit/test_structured_engine.py, test_grammar_process.py and
test_grammar_group.py share."""

from __future__ import annotations

import json
from typing import Any

from loom.engine.llm_engine import LLMEngine
from loom.engine.types import EngineOutput, EngineRequest, FinishReason, SamplingParams, StoppingParams
from loom.frontend.tokenizer import Tokenizer
from loom.structured.grammars import choice_to_ebnf
from loom.structured.spec import GrammarSpec

# The grammars of the grammar-process tests (test_grammar_process.py, test_grammar_group.py)
SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"},
    "n": {"type": "integer", "minimum": 0, "maximum": 9},
    "color": {"enum": ["red", "green"]},
}, "required": ["ok", "n", "color"]}
JSON_SPEC = GrammarSpec("json_schema", json.dumps(SCHEMA), "parameters.constraint.json_schema")
REGEX = GrammarSpec("regex", "[a-c]{2,4}", "parameters.constraint.regex")
CHOICE = GrammarSpec("ebnf", choice_to_ebnf(["yes", "no", "maybe"]), "parameters.constraint.choice")
LONG = GrammarSpec("regex", "(ab|ba|a|b){30,40}", "parameters.constraint.regex")  # many steps
DRAFTED = GrammarSpec("regex", "(ab|ba|a|b){4,40}", "parameters.constraint.regex")  # followed by n-gram drafts


def make_engine(model_dir: Any, **overrides: Any) -> LLMEngine:
    """The grammar-process tests' engine on ``model_dir`` (a tiny model with SmolLM2's vocabulary)."""
    from loom.config import EngineConfig

    return LLMEngine(EngineConfig(model_id=str(model_dir), max_batch_total_tokens=4096, warmup=False, **overrides))


def mixed() -> list[EngineRequest]:
    """Constrained requests of three grammars (one with two completions, one with min_new_tokens)
    and a plain one."""
    return [request("json", JSON_SPEC, n=2, do_sample=True, seed=5), request("regex", REGEX, do_sample=True, seed=1),
            request("choice", CHOICE), request("min", REGEX, min_new=3), request("plain", None, new=12)]


def drafted(tok: Tokenizer, rid: str, new: int, spec: GrammarSpec | None = DRAFTED) -> EngineRequest:
    """A request whose prompt repeats itself, so that n-gram speculation drafts (``spec`` None: plain)."""
    prompt = tuple(tok.encode("ab ab ab ab ab ab ab ab ab ab"))
    stopping = StoppingParams(max_new_tokens=new, ignore_eos=spec is None)
    return EngineRequest(rid, prompt, SamplingParams(constraint=spec), stopping)


def request(rid: str, spec: GrammarSpec | None, new: int = 48, n: int = 1, min_new: int = 0,
            **sampling: Any) -> EngineRequest:
    return EngineRequest(rid, (1, 504, 3458, 28, 253), SamplingParams(constraint=spec, **sampling),
                         StoppingParams(max_new_tokens=new, min_new_tokens=min_new), n=n)


def run(engine: LLMEngine, requests: list[EngineRequest]) -> dict[tuple[str, int], list[EngineOutput]]:
    """Add ``requests`` and step until nothing is unfinished: each completion's outputs; no KV block leaked."""
    outs: dict[tuple[str, int], list[EngineOutput]] = {}
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault((out.request_id, out.index), []).append(out)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "KV blocks leaked"
    return outs


def start(engine: LLMEngine, requests: list[EngineRequest], steps: int) -> dict[tuple[str, int], list[EngineOutput]]:
    """Add ``requests`` and take ``steps`` steps: the outputs so far, by completion (carry on with
    :func:`run` and extend them)."""
    outs: dict[tuple[str, int], list[EngineOutput]] = {}
    for r in requests:
        engine.add_request(r)
    for _ in range(steps):
        for out in engine.step():
            outs.setdefault((out.request_id, out.index), []).append(out)
    return outs


def kill_child_and_finish(engine: LLMEngine, outs: dict[tuple[str, int], list[EngineOutput]]) -> None:
    """Kill the engine's grammar process, then step to the end, adding the outputs to ``outs``."""
    proc = getattr(engine._structured, "_proc", None)
    assert proc is not None, "the engine has no grammar process running"
    proc.kill()
    proc.wait()
    for key, more in run(engine, []).items():
        outs.setdefault(key, []).extend(more)


def ids(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def text(tok: Tokenizer, outs: list[EngineOutput]) -> str:
    return tok.decode(ids(outs), skip_special_tokens=True)


def assert_faulted(outs: list[EngineOutput], field: str, *words: str) -> None:
    """The completion ended with INTERNAL GRAMMAR_MATCHER_FAULT on ``field``, its message holding ``words``."""
    last = outs[-1]
    assert last.finish_reason is FinishReason.ERROR and last.rejection is not None, last
    assert (last.rejection.status, last.rejection.reason, last.rejection.field) == (
        "INTERNAL", "GRAMMAR_MATCHER_FAULT", field)
    assert last.error is not None and all(w in last.error for w in words), last.error

