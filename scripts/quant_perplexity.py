"""Q1 (../shared/bench/WORKLOADS.md): perplexity of SmolLM2-135M over an evaluation text, dense and
with every quantizer, computed by Loom's own model and linear methods (CPU, float32).

The evaluation text is Appendix B of the Jargon File (public domain, bench/texts/); GPTQ and AWQ
calibrate on other chapters (plugins/quant/data/calibration.txt). Windows of 512 tokens, each
scored on its own (no overlap): perplexity = exp(mean negative log-likelihood of tokens 2..512).

    .venv/bin/python scripts/quant_perplexity.py --out bench/results/q1-perplexity.json

Checkpoints are written with `loom quantize` into --work (kept, so a rerun only scores).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
EVAL_TEXT = ROOT / "bench" / "texts" / "jargon-portrait-of-j-random-hacker.txt"

# (label, loom quantize method or None, --quantize, quantize options)
RUNS: list[tuple[str, str | None, str, dict[str, Any]]] = [
    ("dense fp32", None, "none", {}),
    ("RTN int4 g64", "rtn", "auto", {"bits": 4, "group_size": 64}),
    ("GPTQ int4 g64", "gptq", "auto", {"bits": 4, "group_size": 64}),
    ("GPTQ int4 g64 act-order", "gptq", "auto", {"bits": 4, "group_size": 64, "act_order": True}),
    ("AWQ int4 g64", "awq", "auto", {"bits": 4, "group_size": 64}),
    ("FP8 (checkpoint, per-channel, dynamic)", "fp8", "auto", {}),
    ("FP8 (--quantize fp8 while loading)", None, "fp8", {}),
    ("NF4 (checkpoint)", "nf4", "auto", {}),
    ("NF4 (--quantize nf4 while loading)", None, "nf4", {}),
]


def windows(model_dir: Path, length: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model_dir)).encode(EVAL_TEXT.read_text(encoding="utf-8"))
    return [ids[i:i + length] for i in range(0, len(ids) - length + 1, length)]


@torch.no_grad()
def perplexity(model_dir: Path, quantize: str, chunks: list[list[int]]) -> float:
    from helpers.reference_attention import ModelHarness

    from loom.model_loader import load_model
    from loom.plugin_api import default_registry
    from loom_plugins.attention.torch_backend import TorchAttentionBackend

    loaded = load_model(model_dir, torch.float32, torch.device("cpu"), default_registry(), quantize)
    nll, count = 0.0, 0
    for chunk in chunks:
        harness = ModelHarness(loaded.model, loaded.hf_config, block_size=16, num_blocks=len(chunk) // 16 + 1,
                               max_seqs=1, backend_cls=TorchAttentionBackend)
        logits = harness.prefill(chunk)  # [T, V]
        logp = torch.log_softmax(logits[:-1].float(), dim=-1)
        target = torch.tensor(chunk[1:])
        nll -= float(logp.gather(1, target.unsqueeze(1)).sum())
        count += len(chunk) - 1
    return math.exp(nll / count)


def main() -> int:
    from loom.model_loader import resolve_model_dir
    from loom_plugins.quant.make.pipeline import QuantizeRequest, quantize_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-id", default=None, help="default: the embedded SmolLM2-135M-Instruct GGUF")
    parser.add_argument("--work", type=Path, default=Path("/tmp/loom-q1"), help="where checkpoints are written")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--only", default=None, help="comma-separated labels' first words to run (e.g. GPTQ,RTN)")
    args = parser.parse_args()
    torch.manual_seed(0)
    source = resolve_model_dir(args.model_id)
    chunks = windows(source, args.window)
    rows = []
    for label, method, quantize, options in RUNS:
        if args.only and label.split()[0] not in args.only.split(","):
            continue
        model_dir = source
        started = time.monotonic()
        if method is not None:
            model_dir = args.work / label.replace(" ", "_").replace("(", "").replace(")", "").replace(",", "")
            if not (model_dir / "config.json").is_file():
                quantize_model(source, model_dir, QuantizeRequest(method=method, **options))
        made = time.monotonic() - started
        ppl = perplexity(model_dir, quantize, chunks)
        rows.append({"label": label, "method": method or quantize, "perplexity": round(ppl, 3),
                     "quantize_s": round(made, 1), "score_s": round(time.monotonic() - started - made, 1)})
        print(f"{label:42s} ppl {ppl:8.3f}", flush=True)
        result = {"model": args.model_id or "SmolLM2-135M-Instruct (embedded GGUF, dequantized to fp32)",
                  "eval_text": str(EVAL_TEXT.relative_to(ROOT)), "window": args.window, "windows": len(chunks),
                  "tokens_scored": len(chunks) * (args.window - 1), "rows": rows}
        if args.out:  # after every row: a long run that is stopped keeps what it measured
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
