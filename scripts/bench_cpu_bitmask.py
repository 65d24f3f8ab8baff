"""Grammar masks on the CPU: Loom's word-wise kernel against xgrammar's, side by side.

64 rows of SmolLM2's 49,152 logits (S1's batch), masked by (a) the bitmasks xgrammar fills for
S1's eight JSON schemas at their first token and after a few accepted tokens, and (b) random
words (a third all ones, a third all zeros, a third mixed: far more mixed words than a grammar
makes). Each kernel masks a fresh copy of the same logits; the two alternate, and the medians of
``--repeats`` runs are compared. Results must be identical.

    python scripts/bench_cpu_bitmask.py [--out bench/results/cpu-bitmask.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT / "tests"))
    import xgrammar as xg
    from transformers import AutoTokenizer
    from xgrammar.kernels.apply_token_bitmask_inplace_cpu import apply_token_bitmask_inplace_cpu

    from loom.bench.structured import SCHEMAS
    from loom.model_loader import resolve_model_dir
    from loom.sample import cpu_bitmask

    assert cpu_bitmask.available(), "the CPU kernel did not build"
    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))
    info = xg.TokenizerInfo.from_huggingface(tok)
    vocab = info.vocab_size
    compiler = xg.GrammarCompiler(info)
    grammars = [compiler.compile_json_schema(json.dumps(s)) for s in SCHEMAS.values()]
    rows, words = 64, -(-vocab // 32)
    grammar_mask = torch.empty(rows, words, dtype=torch.int32)
    prefix = tok.encode('{"', add_special_tokens=False)
    for i in range(rows):
        m = xg.GrammarMatcher(grammars[i % len(grammars)])
        if i % 2:  # half the rows a few tokens in (inside the object), half at its start
            for t in prefix:
                m.accept_token(t)
        m.fill_next_token_bitmask(grammar_mask, i)
    g = torch.Generator().manual_seed(0)
    kind = torch.randint(0, 3, (rows, words), generator=g)
    mixed = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    random_mask = torch.where(kind == 0, 0, torch.where(kind == 1, -1, mixed)).to(torch.int32)
    logits = torch.randn(rows, vocab)
    report = {"rows": rows, "vocab": vocab, "threads": args.threads, "repeats": args.repeats}
    for name, mask in (("grammar masks", grammar_mask), ("random words", random_mask)):
        share_ones = float((mask == -1).float().mean())
        share_zeros = float((mask == 0).float().mean())
        times: dict[str, list[float]] = {"xgrammar": [], "loom": []}
        outs = {}
        for _ in range(args.repeats):
            for kernel in ("xgrammar", "loom"):
                x = logits.clone()
                t0 = time.perf_counter()
                if kernel == "xgrammar":
                    apply_token_bitmask_inplace_cpu(x, mask, vocab, None)
                else:
                    cpu_bitmask.apply_bitmask_(x, mask, None)
                times[kernel].append(time.perf_counter() - t0)
                outs[kernel] = x
        assert torch.equal(outs["xgrammar"], outs["loom"]), name
        xg_ms = 1e3 * statistics.median(times["xgrammar"])
        loom_ms = 1e3 * statistics.median(times["loom"])
        report[name] = {"xgrammar_ms": xg_ms, "loom_ms": loom_ms, "speedup": xg_ms / loom_ms,
                        "words_all_ones": share_ones, "words_all_zeros": share_zeros}
        print(f"{name}: xgrammar {xg_ms:.2f} ms, loom {loom_ms:.3f} ms ({xg_ms / loom_ms:.1f}x); words all ones "
              f"{share_ones:.0%}, all zeros {share_zeros:.0%}; identical logits")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
