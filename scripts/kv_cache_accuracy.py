"""What ``--kv-cache-dtype fp8`` changes on the real SmolLM2-135M-Instruct (CPU, float32 compute).

Two measurements, each FP8 against the model-dtype cache in the same run:

- Q1's text (the Jargon File appendix of ``scripts/quant_perplexity.py``, the same 8 windows of
  512 tokens): perplexity, KL(model-dtype || FP8) of the next-token distributions and top-1
  agreement. Each window is one prefill whose attention reads every key and value through the
  cache format, as decode steps do.
- Greedy generation through the engine: a fixed set of chat prompts, up to 64 new tokens each
  (ending at EOS), batched: how many completions are identical, and the share of the model-dtype
  completions' tokens generated before the first difference.

    .venv/bin/python scripts/kv_cache_accuracy.py --out bench/results/kv-fp8-accuracy.json
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

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three uses of copper.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish and German.",
    "Give me a short recipe for pancakes.",
    "What is 17 times 23?",
    "Summarize the plot of Romeo and Juliet.",
    "Write a Python function that reverses a string.",
    "What are the planets of the solar system?",
    "Describe a cat to someone who has never seen one.",
    "How does a bicycle stay upright?",
    "Name four programming languages and one strength of each.",
    "What causes the seasons on Earth?",
    "Write a limerick about a programmer.",
]


def windows(model_dir: Path, length: int, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model_dir)).encode(EVAL_TEXT.read_text(encoding="utf-8"))
    return [ids[i:i + length] for i in range(0, len(ids) - length + 1, length)][:count]


@torch.no_grad()
def text_scores(model_dir: Path, chunks: list[list[int]]) -> dict[str, float]:
    from helpers.reference_attention import ModelHarness

    from loom.model_loader import load_model
    from loom.plugin_api import default_registry
    from loom_plugins.attention.torch_backend import TorchAttentionBackend

    class Fp8TorchBackend(TorchAttentionBackend):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            self.use_fp8_kv_cache()

    loaded = load_model(model_dir, torch.float32, torch.device("cpu"), default_registry(), "auto")
    nll = {"auto": 0.0, "fp8": 0.0}
    kl = agree = 0.0
    count = 0
    for chunk in chunks:
        logp = {}
        for name, backend in (("auto", TorchAttentionBackend), ("fp8", Fp8TorchBackend)):
            harness = ModelHarness(loaded.model, loaded.hf_config, block_size=16, num_blocks=len(chunk) // 16 + 1,
                                   max_seqs=1, backend_cls=backend)
            logp[name] = torch.log_softmax(harness.prefill(chunk)[:-1].float(), dim=-1)  # [T - 1, V]
            target = torch.tensor(chunk[1:])
            nll[name] -= float(logp[name].gather(1, target.unsqueeze(1)).sum())
        kl += float((logp["auto"].exp() * (logp["auto"] - logp["fp8"])).sum())
        agree += float((logp["auto"].argmax(-1) == logp["fp8"].argmax(-1)).sum())
        count += len(chunk) - 1
    return {"perplexity_model_dtype": round(math.exp(nll["auto"] / count), 4),
            "perplexity_fp8": round(math.exp(nll["fp8"] / count), 4),
            "kl": round(kl / count, 6), "top1_agreement": round(agree / count, 4), "tokens_scored": count}


def greedy(model_dir: Path, kv_cache_dtype: str, prompts: list[list[int]], new: int) -> tuple[list[list[int]], int]:
    from loom.config import EngineConfig
    from loom.engine.llm_engine import LLMEngine
    from loom.engine.types import EngineRequest, SamplingParams, StoppingParams

    engine = LLMEngine(EngineConfig(model_id=str(model_dir), kv_cache_dtype=kv_cache_dtype, warmup=False,
                                    max_batch_total_tokens=8192))
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"p{i}", tuple(prompt), SamplingParams(),
                                         StoppingParams(max_new_tokens=new)))
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).extend(out.token_ids)
    return [outs[f"p{i}"] for i in range(len(prompts))], engine.worker.kv_bytes_per_token


def generation_scores(model_dir: Path, new: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts: list[list[int]] = []
    for p in PROMPTS:
        rendered: Any = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                tokenize=True)
        prompts.append([int(t) for t in (rendered["input_ids"] if hasattr(rendered, "keys") else rendered)])
    dense, dense_bytes = greedy(model_dir, "auto", prompts, new)
    fp8, fp8_bytes = greedy(model_dir, "fp8", prompts, new)
    first_diff = []
    for a, b in zip(dense, fp8, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        first_diff.append(n)
    return {"prompts": len(prompts), "max_new_tokens": new,
            "identical_completions": sum(a == b for a, b in zip(dense, fp8, strict=True)),
            "completion_lengths": [len(a) for a in dense],
            "tokens_before_first_difference": first_diff,
            "share_before_first_difference": round(sum(first_diff) / sum(len(a) for a in dense), 4),
            "kv_bytes_per_token": {"model_dtype": dense_bytes, "fp8": fp8_bytes},
            "examples": [{"prompt": PROMPTS[i], "model_dtype": tok.decode(dense[i]), "fp8": tok.decode(fp8[i])}
                         for i in range(3)]}


def main() -> int:
    from loom.model_loader import resolve_model_dir

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-id", default=None, help="default: the embedded SmolLM2-135M-Instruct GGUF")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    source = resolve_model_dir(args.model_id)
    started = time.monotonic()
    text = text_scores(source, windows(source, 512, args.windows))
    print(json.dumps(text), flush=True)
    gen = generation_scores(source, args.new_tokens)
    print(json.dumps({k: v for k, v in gen.items() if k != "examples"}), flush=True)
    result = {"command": "python scripts/kv_cache_accuracy.py" + (f" --out {args.out}" if args.out else ""),
              "model": args.model_id or "SmolLM2-135M-Instruct (embedded Q4_1 GGUF, dequantized to fp32)",
              "eval_text": str(EVAL_TEXT.relative_to(ROOT)), "text": text, "generation": gen,
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "seconds": round(time.monotonic() - started, 1)}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
