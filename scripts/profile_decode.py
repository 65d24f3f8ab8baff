"""Where a decode step's time goes: host (cProfile) and device (torch.profiler) for one model.

Usage: python scripts/profile_decode.py random:llama-1b [batch] [out_dir] [async: auto|on|off] [FIELD=VALUE ...]

FIELD=VALUE: further EngineConfig fields, e.g. ``quantize=fp8`` or ``kv_cache_dtype=fp8`` (numbers
are read as numbers); they are part of the report's file name.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import random
import sys
import time
from pathlib import Path

import torch

from loom.config import EngineConfig
from loom.engine.llm_engine import LLMEngine
from loom.engine.types import EngineRequest, SamplingParams, StoppingParams


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "random:llama-1b"
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    out = Path(sys.argv[3] if len(sys.argv) > 3 else ".")
    mode = sys.argv[4] if len(sys.argv) > 4 else "auto"
    extra: dict[str, object] = {}
    for item in sys.argv[5:]:
        key, _, value = item.partition("=")
        extra[key] = int(value) if value.isdigit() else value
    engine = LLMEngine(EngineConfig(model_id=model, max_total_tokens=2048, max_batch_prefill_tokens=16384,
                                    async_scheduling=mode, **extra))  # type: ignore[arg-type]
    rng = random.Random(0)
    for i in range(batch):
        prompt = tuple(rng.randint(10, 1000) for _ in range(512))
        engine.add_request(EngineRequest(f"p{i}", prompt, SamplingParams(),
                                         StoppingParams(max_new_tokens=400, ignore_eos=True)))
    torch.cuda.synchronize()
    warm_ms = []
    prefill_table = ""
    for i in range(20):  # the prefill steps (16384 prompt tokens each), then the first decodes
        t = time.perf_counter()
        if i == 2 and batch * 512 > 2 * 16384:  # a full prefill step (with decode rows), profiled
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as p:
                engine.step()
                torch.cuda.synchronize()
            prefill_table = p.key_averages().table(sort_by="cuda_time_total", row_limit=25)
        else:
            engine.step()
        torch.cuda.synchronize()
        warm_ms.append(round((time.perf_counter() - t) * 1e3, 1))
    print("first 20 steps (ms, synchronized):", warm_ms, flush=True)
    t = time.perf_counter()
    for _ in range(50):
        engine.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t) / 50 * 1e3
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        engine.step()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as p:
        for _ in range(20):
            engine.step()
        torch.cuda.synchronize()
    table = p.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    report = (f"model {model} batch {batch} async {mode} {extra}: {step_ms:.3f} ms per decode step\n"
              f"first 20 steps (ms, synchronized): {warm_ms}\n\n{text.getvalue()}\n\n{table}\n"
              f"\nthe third step (a prefill step, profiled):\n{prefill_table}\n")
    suffix = "".join(f"-{k}-{v}" for k, v in extra.items())
    (out / f"profile-{model.replace(':', '-')}-b{batch}-{mode}{suffix}.txt").write_text(report)
    print(report[:3000])


if __name__ == "__main__":
    main()
