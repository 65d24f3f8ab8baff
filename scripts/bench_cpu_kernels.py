"""The CPU kernels against what they replace, per call, on this machine (2 threads by default).

1. ``gguf`` linear layers (SmolLM2-135M's shapes, Q4_1 and the Q8_0 tied head) against
   ``F.linear`` (MKL) on the same, dequantized, weights, for batch sizes M; weights in cache.
2. One batch-1 decode step's projections (all 30 layers and the head, cycled so nothing stays
   in cache) on the blocks against MKL on dense fp32 weights.
3. Decode attention per layer (9 query heads, 3 KV heads, head_dim 64, 16-token blocks): the
   in-place kernel against gather + SDPA (``LOOM_CPU_KERNELS=0``'s path).

    python scripts/bench_cpu_kernels.py [threads]

Results: bench/results/cpu-kernels.txt, summarised in docs/benchmarks.md.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.source_tree import make_importable

make_importable()

from loom_plugins.attention import cpu_kernels  # noqa: E402
from loom_plugins.quant import gguf  # noqa: E402

# (out, in, GGUF type): qkv, o, gate_up, down of a SmolLM2 layer, and the tied head
SHAPES = [(960, 576, "Q4_1"), (576, 576, "Q4_1"), (3072, 576, "Q4_1"), (576, 1536, "Q4_1"),
          (49152, 576, "Q8_0")]
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}


def seconds(fn: Callable[[], object], repeat: int) -> float:
    fn()
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def random_layer(out: int, inp: int, type_name: str) -> gguf.GGUFLinear:
    """Random payload bytes with small finite fp16 scales (speed does not depend on the values)."""
    nb = inp // 32
    raw = torch.randint(0, 256, (out, nb, BLOCK_BYTES[type_name]), dtype=torch.uint8)
    scales = (torch.rand(out, nb, 2) * 0.02 - 0.01).half()
    raw[:, :, 0:2] = scales[:, :, 0:1].contiguous().view(torch.uint8)
    if type_name == "Q4_1":
        raw[:, :, 2:4] = scales[:, :, 1:2].contiguous().view(torch.uint8)
    return gguf.GGUFLinear.from_blocks(raw.reshape(out, -1), type_name, inp)


def linear_per_call() -> None:
    print("1. gguf linear vs F.linear (MKL) on the dequantized weight, per call, weights in cache")
    for out, inp, type_name in SHAPES:
        layer = random_layer(out, inp, type_name)
        dense = layer.dequantized_weight()
        for m in (1, 2, 8, 32, 128, 512, 4096):
            x = torch.randn(m, inp)
            repeat = max(3, int(2e8 / (m * out * inp)))
            kernel = torch.ops.loom_gguf_cpu.linear
            ours = seconds(partial(kernel, x, layer.qs, layer.d, layer.m, layer.qtype, out), repeat)
            mkl = seconds(partial(F.linear, x, dense), repeat)
            flop = 2 * m * out * inp
            print(f"  {type_name} {out}x{inp} M={m:<5} kernel {ours * 1e3:8.3f} ms ({flop / ours / 1e9:5.0f} GFLOP/s)"
                  f"  MKL {mkl * 1e3:8.3f} ms ({flop / mkl / 1e9:5.0f})  MKL/kernel {mkl / ours:5.2f}x")


def decode_step_projections() -> None:
    print("2. a batch-1 decode step's projections, 30 layers + head, cycled (weights from memory)")
    layers = [random_layer(out, inp, t) for _ in range(30) for out, inp, t in SHAPES[:4]]
    layers.append(random_layer(*SHAPES[4]))
    dense = [layer.dequantized_weight() for layer in layers]
    xs = {576: torch.randn(1, 576), 1536: torch.randn(1, 1536)}
    ours = seconds(lambda: [layer(xs[layer.in_features]) for layer in layers], 20)
    mkl = seconds(lambda: [F.linear(xs[w.shape[1]], w) for w in dense], 10)
    print(f"  blocks {ours * 1e3:.1f} ms, dense fp32 {mkl * 1e3:.1f} ms ({mkl / ours:.2f}x)")


def decode_attention_per_layer() -> None:
    print("3. decode attention per layer: in-place kernel vs gather + SDPA")
    from loom.layers.attention import AttentionMetadata
    from loom_plugins.attention.torch_backend import TorchAttentionBackend

    cache = torch.randn(2, 4096, 16, 3, 64)
    for batch, length in ((1, 140), (32, 200), (64, 400)):
        blocks = (length + 15) // 16
        tables = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)
        meta = AttentionMetadata(
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
            seq_lens=torch.full((batch,), length, dtype=torch.int32),
            slot_mapping=tables[:, -1].long() * 16 + (length - 1) % 16, block_tables=tables,
            query_lens_cpu=[1] * batch, seq_lens_cpu=[length] * batch, max_query_len=1,
            max_seq_len=length, block_size=16)
        q, kv = torch.randn(batch, 9, 64), torch.randn(batch, 3, 64)
        results = []
        for use_kernel in (True, False):
            backend = TorchAttentionBackend(9, 3, 64, torch.float32, torch.device("cpu"))
            backend.cpu_kernel = use_kernel and cpu_kernels.cpu_decode_kernel_available()
            plan = backend.prepare(meta)
            results.append(seconds(partial(backend.forward, q, kv, kv, cache, meta, plan, 0.125, None), 200))
        print(f"  {batch} x {length} tokens: kernel {results[0] * 1e6:7.1f} us, gather + SDPA "
              f"{results[1] * 1e6:7.1f} us ({results[1] / results[0]:.2f}x)")


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    if not gguf.kernel_available():
        sys.exit(f"the gguf kernel is unavailable here: {gguf.cpu_unsupported_reason()}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    linear_per_call()
    decode_step_projections()
    decode_attention_per_layer()


if __name__ == "__main__":
    main()
