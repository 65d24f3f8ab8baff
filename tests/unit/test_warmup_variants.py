"""Before serving, the engine runs a prefill of each token count at which one of the model's
kernels compiles another variant (a quantized layer's W4A16 GEMM tiles by token-count bucket), one
request at a time, so that a prompt of a new size never compiles a kernel mid-serving. On the CPU
no kernel depends on the count; the worker's answer is replaced here to see what the engine does
with one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from loom.config import EngineConfig
from loom.engine.llm_engine import LLMEngine
from loom.worker.kernel_warmup import WarmUpCounts


def test_each_count_runs_alone_as_one_step_of_that_many_tokens(tiny_model_dir: Callable[[str], Path]) -> None:
    engine = LLMEngine(EngineConfig(model_id=str(tiny_model_dir("llama")), block_size=4,
                                    max_batch_total_tokens=2048, warmup=False))
    asked: list[tuple[int, int]] = []

    def counts(max_tokens: int, max_rows: int) -> WarmUpCounts:
        asked.append((max_tokens, max_rows))
        return WarmUpCounts(body=(1, 5, 17, 33, 65), head=(2, 3))

    steps: list[int] = []
    execute = engine.worker.execute

    def recording(plan: Any) -> Any:
        steps.append(plan.num_tokens)
        return execute(plan)

    engine.worker.warm_up_token_counts = counts  # type: ignore[method-assign]
    engine.worker.execute = recording  # type: ignore[method-assign]
    free = engine.block_manager.num_free_blocks
    engine._warmup_kernel_variants()
    assert asked == [(min(engine.config.max_batch_prefill_tokens, engine.max_model_len - 1), 1)]
    # each count is one step of exactly that many tokens (no prefix-cache hit shortens a later
    # prompt: each starts with a token of its own), and nothing else runs
    assert steps == [1, 5, 17, 33, 65]
    assert not engine.has_unfinished() and engine.num_steps == 0
    assert engine.block_manager.num_free_blocks == free


def test_nothing_runs_where_no_kernel_depends_on_the_count(tiny_model_dir: Callable[[str], Path]) -> None:
    engine = LLMEngine(EngineConfig(model_id=str(tiny_model_dir("llama")), block_size=4,
                                    max_batch_total_tokens=2048, warmup=False))
    assert engine.worker.warm_up_token_counts(512, 1) == WarmUpCounts()  # dense layers on the CPU
    ran: list[Any] = []
    execute = engine.worker.execute
    engine.worker.execute = lambda plan: ran.append(plan) or execute(plan)  # type: ignore[method-assign]
    engine._warmup_kernel_variants()
    assert ran == []
