"""Q1 (../shared/bench/WORKLOADS.md): how much each quantizer changes SmolLM2-135M, computed by Loom's
own model and linear methods (CPU, float32).

The evaluation text is Appendix B of the Jargon File (public domain, bench/texts/); GPTQ and AWQ
calibrate on other chapters (plugins/quant/data/calibration.txt). The first ``--windows`` (8)
windows of 512 tokens, each scored on its own: 4,088 predicted tokens. Per row:

- perplexity: exp(mean negative log-likelihood of tokens 2..512 of each window);
- KL: mean over those positions of KL(dense || quantized) of the next-token distributions, the
  direct measure of how far quantization moved the model (perplexity can move either way by
  chance when the model moves a lot);
- top-1: the share of positions where the quantized model's most likely token is the dense one's.

    .venv/bin/python scripts/quant_perplexity.py --out bench/results/q1-perplexity.json
    .venv/bin/python scripts/quant_perplexity.py --layer-errors --out bench/results/q1-gptq-layers.json
    .venv/bin/python scripts/quant_perplexity.py --grid-check --out bench/results/q1-grid-check.json

Checkpoints are written with `loom quantize` into --work (kept, so a rerun only scores), and so
are the dense model's log-probabilities (one file per window).

``--layer-errors`` checks GPTQ against round-to-nearest layer by layer, as ``loom quantize``
runs it (each linear group quantized in compute order on the outputs of the layers quantized
before): the relative output error ``||X (W - Q)^T||^2 / ||X W^T||^2`` of GPTQ and of RTN with
the same group size, on the calibration activations GPTQ minimises it on (computed from the
Hessian) and on the evaluation text's activations, the latter split into the first position of
each window (the attention sink, whose activations are thousands of times larger in some
layers) and the others.
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
    ("GPTQ int4 g64 12 windows", "gptq", "auto", {"bits": 4, "group_size": 64, "samples": 12}),
    ("GPTQ int4 g64 sink x64", "gptq", "auto", {"bits": 4, "group_size": 64, "sink_weight": 64.0}),
    ("AWQ int4 g64", "awq", "auto", {"bits": 4, "group_size": 64}),
    ("RTN int4 g32", "rtn", "auto", {"bits": 4, "group_size": 32}),
    ("GPTQ int4 g32", "gptq", "auto", {"bits": 4, "group_size": 32}),
    ("GPTQ int4 g32 act-order", "gptq", "auto", {"bits": 4, "group_size": 32, "act_order": True}),
    ("AWQ int4 g32", "awq", "auto", {"bits": 4, "group_size": 32}),
    ("GPTQ int8 g64 act-order", "gptq", "auto", {"bits": 8, "group_size": 64, "act_order": True}),
    # the head quantized too (--lm-head: GPTQ's lm_head true; SmolLM2's tied head gets its own tensors)
    ("Head too: RTN int4 g64", "rtn", "auto", {"bits": 4, "group_size": 64, "lm_head": True}),
    ("Head too: GPTQ int4 g64 act-order", "gptq", "auto", {"bits": 4, "group_size": 64, "act_order": True,
                                                           "lm_head": True}),
    ("Head too: GPTQ int4 g32 act-order", "gptq", "auto", {"bits": 4, "group_size": 32, "act_order": True,
                                                           "lm_head": True}),
    ("Head too: GPTQ int8 g64 act-order", "gptq", "auto", {"bits": 8, "group_size": 64, "act_order": True,
                                                           "lm_head": True}),
    ("FP8 (checkpoint, per-channel, dynamic)", "fp8", "auto", {}),
    ("FP8 (--quantize fp8 while loading)", None, "fp8", {}),
    ("NF4 (checkpoint)", "nf4", "auto", {}),
    ("NF4 (--quantize nf4 while loading)", None, "nf4", {}),
]


def windows(model_dir: Path, length: int, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model_dir)).encode(EVAL_TEXT.read_text(encoding="utf-8"))
    return [ids[i:i + length] for i in range(0, len(ids) - length + 1, length)][:count]


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in label.replace(" ", "_"))


@torch.no_grad()
def window_logprobs(model_dir: Path, quantize: str, chunks: list[list[int]]) -> Any:
    """Yields each window's next-token log-probabilities ``[T - 1, V]`` (float32)."""
    from helpers.reference_attention import ModelHarness

    from loom.model_loader import load_model
    from loom.plugin_api import default_registry
    from loom_plugins.attention.torch_backend import TorchAttentionBackend

    loaded = load_model(model_dir, torch.float32, torch.device("cpu"), default_registry(), quantize)
    for chunk in chunks:
        harness = ModelHarness(loaded.model, loaded.hf_config, block_size=16, num_blocks=len(chunk) // 16 + 1,
                               max_seqs=1, backend_cls=TorchAttentionBackend)
        yield torch.log_softmax(harness.prefill(chunk)[:-1].float(), dim=-1)


def score(model_dir: Path, quantize: str, chunks: list[list[int]], dense_dir: Path) -> dict[str, float]:
    """Perplexity, and KL / top-1 agreement against the dense log-probabilities cached in ``dense_dir``
    (written there on the first, dense, call)."""
    nll = kl = agree = 0.0
    count = 0
    for i, logp in enumerate(window_logprobs(model_dir, quantize, chunks)):
        target = torch.tensor(chunks[i][1:])
        nll -= float(logp.gather(1, target.unsqueeze(1)).sum())
        cached = dense_dir / f"dense-logprobs-{i}.pt"
        if not cached.is_file():
            torch.save(logp, cached)
        dense = torch.load(cached)
        kl += float((dense.exp() * (dense - logp)).sum())
        agree += float((dense.argmax(-1) == logp.argmax(-1)).sum())
        count += len(chunks[i]) - 1
    return {"perplexity": round(math.exp(nll / count), 3), "kl": round(kl / count, 4),
            "top1_agreement": round(agree / count, 4), "tokens_scored": count}


def quality_table(args: argparse.Namespace, source: Path, chunks: list[list[int]]) -> dict[str, Any]:
    from loom_plugins.quant.make.pipeline import QuantizeRequest, quantize_model

    args.work.mkdir(parents=True, exist_ok=True)
    dense_dir = args.work / f"dense-logprobs-w{args.window}"
    dense_dir.mkdir(exist_ok=True)
    rows = []
    result: dict[str, Any] = {}
    for label, method, quantize, options in RUNS:
        if args.only and not any(label.startswith(prefix) for prefix in args.only.split(",")) \
                and label != "dense fp32":  # the dense row comes first: the others compare with it
            continue
        model_dir = source
        started = time.monotonic()
        if method is not None:
            model_dir = args.work / _slug(label)
            if not (model_dir / "config.json").is_file():
                quantize_model(source, model_dir, QuantizeRequest(method=method, **options))
        made = time.monotonic() - started
        figures = score(model_dir, quantize, chunks, dense_dir)
        rows.append({"label": label, "method": method or quantize, **figures, "quantize_s": round(made, 1),
                     "score_s": round(time.monotonic() - started - made, 1)})
        print(f"{label:42s} ppl {figures['perplexity']:8.3f}  KL {figures['kl']:.4f}  top-1 "
              f"{figures['top1_agreement']:.3f}", flush=True)
        result = {"model": args.model_id or "SmolLM2-135M-Instruct (embedded Q4_1 GGUF, dequantized to fp32)",
                  "eval_text": str(EVAL_TEXT.relative_to(ROOT)), "window": args.window, "windows": len(chunks),
                  "tokens_scored": figures["tokens_scored"], "rows": rows}
        if args.out:  # after every row: a long run that is stopped keeps what it measured
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


@torch.no_grad()
def layer_errors(args: argparse.Namespace, source: Path, chunks: list[list[int]]) -> dict[str, Any]:
    """GPTQ against RTN, layer by layer (see the module docstring)."""
    from transformers import AutoTokenizer

    from loom_plugins.quant.make.calibration import calibration_windows
    from loom_plugins.quant.make.gptq_solver import HessianAccumulator, gptq_quantize
    from loom_plugins.quant.make.group_quant import rtn
    from loom_plugins.quant.make.pipeline import (
        GPTQ_ORDER,
        capture_inputs,
        first_layer_inputs,
        load_source,
        run_layer,
    )

    model = load_source(source)
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    calib = calibration_windows(tokenizer, args.samples, 512, int(model.config.vocab_size))
    hidden, kwargs = first_layer_inputs(model, calib)
    held, held_kwargs = first_layer_inputs(model, torch.tensor(chunks))
    gs = args.group_size

    def rel(err: torch.Tensor, w: torch.Tensor, h: torch.Tensor) -> float:  # tr(E H E^T) / tr(W H W^T)
        return float(torch.einsum("oi,ij,oj->", err.double(), h, err.double()) /
                     torch.einsum("oi,ij,oj->", w.double(), h, w.double()))

    rows = []
    for li, layer in enumerate(model.model.layers):
        for group in GPTQ_ORDER:
            modules = {n: m for n, m in layer.named_modules() if n.rpartition(".")[2] in group}
            first = next(iter(modules))
            acc = HessianAccumulator(modules[first].in_features)
            capture_inputs(layer, hidden, kwargs, {first: modules[first]}, lambda _n, x, a=acc: a.add(x))
            seen: list[torch.Tensor] = []
            capture_inputs(layer, held, held_kwargs, {first: modules[first]}, lambda _n, x, s=seen: s.append(x))
            x_eval = seen[0].double()  # [windows, T, in]
            h_sink = x_eval[:, 0].t() @ x_eval[:, 0]
            h_rest = x_eval[:, 1:].reshape(-1, x_eval.shape[-1]).t() @ x_eval[:, 1:].reshape(-1, x_eval.shape[-1])
            w = torch.cat([m.weight.data for m in modules.values()]).float()
            h = acc.hessian()
            q_gptq = gptq_quantize(w, h, 4, gs, sym=True, act_order=args.act_order, damp=args.damp).dequantize()
            q_rtn = rtn(w, 4, gs, sym=True).dequantize()
            row: dict[str, Any] = {"layer": li, "linears": "/".join(group)}
            for name, q in (("gptq", q_gptq), ("rtn", q_rtn)):
                row[f"{name}_calibration"] = rel(q - w, w, h)
                row[f"{name}_eval_rest"] = rel(q - w, w, h_rest)
                row[f"{name}_eval_sink"] = rel(q - w, w, h_sink)
            sink_share = float(torch.trace(h_sink) / (torch.trace(h_sink) + torch.trace(h_rest)))
            row["eval_sink_share_of_input_energy"] = round(sink_share, 4)
            rows.append(row)
            print(f"L{li:02d} {row['linears']:22s} calibration gptq/rtn {row['gptq_calibration']:.5f}/"
                  f"{row['rtn_calibration']:.5f} | eval tokens 2..T {row['gptq_eval_rest']:.5f}/"
                  f"{row['rtn_eval_rest']:.5f} | eval sink {row['gptq_eval_sink']:.5f}/{row['rtn_eval_sink']:.5f} "
                  f"(sink share {sink_share:.3f})", flush=True)
            start = 0  # continue as loom quantize does: this group's GPTQ weights
            for m in modules.values():
                m.weight.data.copy_(q_gptq[start:start + m.out_features])
                start += m.out_features
        hidden = run_layer(layer, hidden, kwargs)
        held = run_layer(layer, held, held_kwargs)
    summary = {k: sum(r[k] < r[k.replace("gptq", "rtn")] for r in rows)
               for k in ("gptq_calibration", "gptq_eval_rest", "gptq_eval_sink")}
    print(f"groups where GPTQ's error is below RTN's (of {len(rows)}): {summary}", flush=True)
    return {"group_size": gs, "act_order": args.act_order, "damp": args.damp, "calibration_tokens": calib.numel(),
            "groups": len(rows), "gptq_below_rtn": summary, "rows": rows}


@torch.no_grad()
def grid_check(source: Path) -> dict[str, Any]:
    """Do SmolLM2's "dense" weights (its Q4_1 GGUF dequantized) favour round-to-nearest? For every
    decoder linear: the relative weight error ``||Q(W) - W|| / ||W||`` of Q4_1's own rounding (per
    32 inputs, ``min + d * q`` with a float minimum), of RTN with integer zero points (the GPTQ /
    AWQ formats) at g32 asymmetric and g64 symmetric, and of the same RTNs on a Gaussian matrix
    of the same shape and spread (a weight on no grid)."""
    from loom_plugins.quant.make.group_quant import rtn
    from loom_plugins.quant.make.pipeline import decoder_linears, load_source

    def q4_1(w: torch.Tensor) -> torch.Tensor:
        blocks = w.view(w.shape[0], -1, 32)
        lo, hi = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
        d = ((hi - lo) / 15).clamp(min=1e-12)
        return (torch.round((blocks - lo) / d).clamp(0, 15) * d + lo).view_as(w)

    def rel(q: torch.Tensor, w: torch.Tensor) -> float:
        return float((q - w).norm() / w.norm())

    sums: dict[str, float] = {}
    linears = decoder_linears(load_source(source))
    g = torch.Generator().manual_seed(0)
    for linear in linears.values():
        w = linear.weight.data.float()
        gauss = torch.randn(w.shape, generator=g) * w.std()
        figures = {"q4_1_float_minimum": rel(q4_1(w), w), "rtn_g32_asym": rel(rtn(w, 4, 32, False).dequantize(), w),
                   "rtn_g64_sym": rel(rtn(w, 4, 64, True).dequantize(), w),
                   "gaussian_rtn_g32_asym": rel(rtn(gauss, 4, 32, False).dequantize(), gauss),
                   "gaussian_rtn_g64_sym": rel(rtn(gauss, 4, 64, True).dequantize(), gauss)}
        for k, v in figures.items():
            sums[k] = sums.get(k, 0.0) + v / len(linears)
    result = {"linears": len(linears), "mean_relative_weight_error": {k: round(v, 5) for k, v in sums.items()}}
    print(json.dumps(result, indent=2), flush=True)
    return result


def main() -> int:
    from loom.model_loader import resolve_model_dir

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-id", default=None, help="default: the embedded SmolLM2-135M-Instruct GGUF")
    parser.add_argument("--work", type=Path, default=Path("/tmp/loom-q1"), help="where checkpoints are written")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--windows", type=int, default=8, help="windows scored (the text holds 10 of 512)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--only", default=None, help="comma-separated label prefixes to run (e.g. GPTQ,RTN)")
    parser.add_argument("--layer-errors", action="store_true", help="GPTQ vs RTN layer by layer instead")
    parser.add_argument("--grid-check", action="store_true",
                        help="instead: do the Q4_1-derived weights favour round-to-nearest? (weight errors)")
    parser.add_argument("--group-size", type=int, default=64, help="--layer-errors: the group size")
    parser.add_argument("--act-order", action="store_true", help="--layer-errors: GPTQ with act-order")
    parser.add_argument("--damp", type=float, default=0.01, help="--layer-errors: GPTQ's damping (share of mean H_dd)")
    parser.add_argument("--samples", type=int, default=8, help="--layer-errors: calibration windows of 512")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    source = resolve_model_dir(args.model_id)
    chunks = windows(source, args.window, args.windows)
    if args.grid_check:
        result = grid_check(source)
        if args.out:
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    elif args.layer_errors:
        result = layer_errors(args, source, chunks)
        if args.out:
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    else:
        quality_table(args, source, chunks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
