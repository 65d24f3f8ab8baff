"""Whether the W4A16 dense path (dequantize a layer's weight, then cuBLAS) gains from dequantizing
the *next* layer's weight on a second stream while cuBLAS multiplies the current one.

At 129 tokens and more a W4A16 layer writes its whole bf16 ``W^T`` and cuBLAS reads it back:
over llama-8b's four layers at 256 tokens 328 us against bf16 cuBLAS's 174 (H200, session 30),
the difference about the dequantization's bytes (0.5 read + 2 written a weight). cuBLAS at 256
tokens is bound by the tensor cores, the dequantization by memory: run side by side they could
overlap. This times, over llama-8b's layers in execution order (qkv, o, gate_up, down, repeated
for ``--layers`` decoder layers), each replayed from a CUDA graph:

- ``bf16``: cuBLAS on dense bf16 weights of the same shapes (the floor);
- ``serial``: today's dense path (``w4a16_linear`` with the dense plan);
- ``pipelined``: the same kernels, the next weight dequantized on a side stream into the other of
  two buffers while the current one is multiplied (events order the buffers' reuse).

    PYTHONPATH=service:plugins/.. python scripts/bench_dequant_overlap.py [--tokens 256,192,160] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_w4a16_plans import _import, _time_graphed  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="256,192,160,512")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers in the sequence timed")
    parser.add_argument("--out")
    args = parser.parse_args()
    ql, wt = _import()
    device, dtype = torch.device("cuda"), torch.bfloat16
    scheme = ql.while_loading_scheme("gptq")
    layouts: list[Any] = []
    dense: list[torch.Tensor] = []
    for _name, k, parts in ql.LLAMA_8B_SHAPES:
        layer = ql.build_layer(scheme, k, parts, ql.dense_parts(k, parts, seed=1), device, dtype)
        layouts.append(layer.w4a16)
        dense.append(torch.randn(k, sum(parts), device=device, dtype=dtype) * 0.02)
    seq = list(range(len(layouts))) * args.layers
    biggest = max(lay.in_features * lay.out_features for lay in layouts)
    bufs = [torch.empty(biggest, device=device, dtype=dtype) for _ in range(2)]
    side = torch.cuda.Stream()
    results: list[dict[str, Any]] = []
    for m in [int(t) for t in args.tokens.split(",")]:
        xs = [torch.randn(m, lay.in_features, device=device, dtype=dtype) for lay in layouts]
        outs = [torch.empty(m, lay.out_features, device=device, dtype=dtype) for lay in layouts]

        def bf16(xs: list[torch.Tensor] = xs, outs: list[torch.Tensor] = outs) -> None:
            for i in seq:
                torch.matmul(xs[i], dense[i], out=outs[i])

        def serial(xs: list[torch.Tensor] = xs) -> None:
            for i in seq:
                wt.w4a16_linear(xs[i], layouts[i], dense_from=1)

        def pipelined(xs: list[torch.Tensor] = xs, outs: list[torch.Tensor] = outs) -> None:
            main = torch.cuda.current_stream()
            ready = [torch.cuda.Event(), torch.cuda.Event()]
            done = [torch.cuda.Event(), torch.cuda.Event()]

            def view(j: int, i: int) -> torch.Tensor:
                lay = layouts[i]
                return bufs[j][: lay.in_features * lay.out_features].view(lay.in_features, lay.out_features)

            side.wait_stream(main)
            with torch.cuda.stream(side):
                wt.dequantize_t(layouts[seq[0]], dtype, out=view(0, seq[0]))
                ready[0].record(side)
            for pos, i in enumerate(seq):
                j = pos % 2
                if pos + 1 < len(seq):
                    nxt, jn = seq[pos + 1], 1 - j
                    with torch.cuda.stream(side):
                        if pos >= 1:
                            side.wait_event(done[jn])  # the multiply before this one read that buffer
                        wt.dequantize_t(layouts[nxt], dtype, out=view(jn, nxt))
                        ready[jn].record(side)
                main.wait_event(ready[j])
                torch.matmul(xs[i], view(j, i), out=outs[i])
                done[j].record(main)
            main.wait_stream(side)

        # the pipelined products equal the serial ones (the same kernels, the same buffers' values)
        serial_out = [wt.w4a16_linear(xs[i], layouts[i], dense_from=1) for i in range(len(layouts))]
        pipelined()
        torch.cuda.synchronize()
        same = all(torch.equal(serial_out[i], outs[i]) for i in range(len(layouts)))
        row: dict[str, Any] = {"tokens": m, "layers": args.layers, "pipelined_equals_serial": same}
        for name, fn in (("bf16", bf16), ("serial", serial), ("pipelined", pipelined)):
            row[name + "_us_per_layer"] = _time_graphed(fn, device, reps=3) * 1e6 / args.layers
        row["serial_over_bf16"] = row["serial_us_per_layer"] / row["bf16_us_per_layer"]
        row["pipelined_over_bf16"] = row["pipelined_us_per_layer"] / row["bf16_us_per_layer"]
        print(json.dumps(row), flush=True)
        results.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
