"""``loom quantize --method gptq|awq|rtn|fp8|nf4 [--bits 4] [--group-size 128] MODEL OUT_DIR``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any


def add_quantize_command(sub: Any) -> None:
    p = sub.add_parser(
        "quantize", help="write a GPTQ, AWQ, RTN, FP8 or NF4 checkpoint of a model",
        description="Quantize MODEL (anything --model-id takes: a Hugging Face directory, a .gguf file, "
                    "random:NAME) into OUT_DIR: config.json with its quantization_config, model.safetensors and "
                    "the tokenizer files. gptq and awq calibrate on a text shipped with Loom; rtn rounds to "
                    "nearest (GPTQ format); fp8 (compressed-tensors, per-channel) and nf4 (bitsandbytes) need no "
                    "calibration.")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("out_dir", metavar="OUT_DIR", type=Path)
    p.add_argument("--method", required=True, choices=("gptq", "awq", "rtn", "fp8", "nf4"))
    p.add_argument("--bits", type=int, default=4, help="gptq / rtn: 2, 4 or 8; awq: 4 (default: 4)")
    p.add_argument("--group-size", type=int, default=128,
                   help="inputs per scale (gptq, rtn, awq); -1: one per output channel (gptq, rtn). Must divide "
                        "every layer's input size: SmolLM2's 576 takes 64 or 32 (default: 128)")
    p.add_argument("--act-order", action="store_true", help="gptq: quantize inputs by decreasing activation")
    p.add_argument("--lm-head", action="store_true",
                   help="gptq / rtn: quantize the output head too (quantization_config.lm_head: true, as GPTQModel "
                        "writes it; a tied head gets tensors of its own). Fewer bytes a decode step, more error")
    p.add_argument("--samples", type=int, default=8, help="calibration windows (default: 8)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per calibration window (default: 512)")
    p.add_argument("--damp", type=float, default=0.01,
                   help="gptq: damping added to the Hessian's diagonal, as a share of its mean (default: 0.01)")
    p.add_argument("--sink-weight", type=float, default=1.0,
                   help="gptq: times the first token of each calibration window (the attention sink) counts in "
                        "the Hessian (default: 1)")
    p.add_argument("--device", default="auto",
                   help="where each layer is calibrated and quantized: cpu, cuda (cuda:N), or auto: cuda when a "
                        "CUDA device is present (one decoder layer on it at a time; the model stays in host "
                        "memory) (default: auto)")
    p.add_argument("--force", action="store_true", help="write into an OUT_DIR that is not empty")
    p.set_defaults(func=run_quantize)


def run_quantize(args: argparse.Namespace) -> int:
    import torch

    from loom.config import ConfigError
    from loom.model_loader import check_model_id, resolve_model_dir

    from .pipeline import QuantizeError, QuantizeRequest, quantize_model

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    request = QuantizeRequest(method=args.method, bits=args.bits, group_size=args.group_size,
                              act_order=args.act_order, samples=args.samples, seq_len=args.seq_len,
                              damp=args.damp, sink_weight=args.sink_weight, device=device, lm_head=args.lm_head)
    out_dir: Path = args.out_dir
    try:
        request.check()
        check_model_id(args.model)
        if out_dir.exists() and any(out_dir.iterdir()) and not args.force:
            raise QuantizeError(f"OUT_DIR {out_dir} is not empty; choose another or pass --force")
        started = time.monotonic()
        quantize_model(resolve_model_dir(args.model), out_dir, request)
    except (QuantizeError, ConfigError) as exc:
        print(f"loom quantize: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out_dir} ({request.method} on {request.device}, {time.monotonic() - started:.0f} s); serve it with "
          f"loom serve --model-id {out_dir}")
    return 0
