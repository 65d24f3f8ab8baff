"""The sampler's time for a greedy step, the one-launch kernel (``loom.sample.greedy_triton``)
against the six torch launches (``LOOM_GREEDY_KERNEL=0``), side by side in one process.

The sampler runs eagerly after each step's forward (not in its CUDA graph), so a call is timed as
the engine makes it: back to back on the stream, ``REPS`` calls between two CUDA events, after a
warm-up, the median of ``ROUNDS`` such runs. A call's time is then the longer of its kernels'
time and its launches' time on the host, which is what a step waits for.

    PYTHONPATH=service python scripts/bench_sampler.py [--out FILE]

Rows: 1 (W1), 64 (S1) and 256 (W2); vocabularies: SmolLM2's 49,152, Llama 3's 128,256 and
Qwen3's 151,936. See docs/gpu-kernels.md ("The greedy pick in one launch").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))

from loom import kernel_switches
from loom.sample.batch import SamplingBatch
from loom.sample.sampler import Sampler

ROWS = (1, 64, 256)
VOCABS = {"smollm2": 49152, "llama-3": 128256, "qwen3": 151936}
REPS, ROUNDS = 200, 5


def us_per_call(logits: torch.Tensor, kernel: bool) -> float:
    kernel_switches.greedy_kernel = kernel
    sampler, batch = Sampler(), SamplingBatch(None, None, None, False, 0)
    for _ in range(20):
        sampler(logits, batch)
    torch.cuda.synchronize()
    runs = []
    for _ in range(ROUNDS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPS):
            sampler(logits, batch)
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) * 1e3 / REPS)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows_out = []
    for name, vocab in VOCABS.items():
        for n in ROWS:
            logits = torch.randn(n, vocab, device=dev) * 4
            torch_us = us_per_call(logits, kernel=False)
            kernel_us = us_per_call(logits, kernel=True)
            rows_out.append({"vocab": name, "V": vocab, "rows": n, "torch_us": round(torch_us, 2),
                             "kernel_us": round(kernel_us, 2), "speedup": round(torch_us / kernel_us, 2)})
            print(f"{name:8s} V={vocab:6d} rows={n:3d}: torch {torch_us:7.2f} us, one launch {kernel_us:7.2f} us "
                  f"({torch_us / kernel_us:.2f}x)", flush=True)
    kernel_switches.greedy_kernel = True
    if args.out:
        Path(args.out).write_text(json.dumps({
            "command": "PYTHONPATH=service python scripts/bench_sampler.py" + (f" --out {args.out}" if args.out else ""),
            "date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(dev),
            "torch": torch.__version__, "reps": REPS, "rounds": ROUNDS, "rows": rows_out}, indent=1) + "\n")


if __name__ == "__main__":
    main()
