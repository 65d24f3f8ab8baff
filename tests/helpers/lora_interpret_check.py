"""The LoRA Triton kernels (``plugins/lora/sgmv_triton.py``) on the CPU, through Triton's
interpreter, against the torch path of ``loom.lora.layers`` on random slot tables: base rows
untouched bit for bit, adapter rows within float32 rounding. Run as a script in its own process
(``tests/unit/test_lora_kernels.py`` runs it): the interpreter must be on before the kernels are
defined. fp32 and fp16 (the interpreter's bf16 dots are wrong, see paged_interpret_check.py)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _setup() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import triton_interpret

    triton_interpret.setup_script()


# (rows' slots, slots S, max rank R, the fused parts' output sizes, in, dtype, ordered). The
# kernels' tiles are 16 rows here (64 in the last case) and 16..128 outputs, K in 64-blocks; "ordered" goes through the
# layer (LoraBatch.kernel_order: rows sorted by slot, the parts passed), else a direct call
# without an order (parts passed too, but for the first four cases: the old signature).
CASES = [
    ([0, 1, 1, 2, 0, 3, 3, 3], 4, 16, [96], 64, "float32", False),  # a mixed step: base, prefill and decode rows
    ([2, 2, 2, 2], 3, 48, [70], 130, "float32", False),  # one adapter, sizes off the block sizes
    ([0, 0, 0], 2, 8, [64], 64, "float32", False),  # only base rows: nothing changes
    ([1, 0, 2, 1, 2], 3, 32, [200], 96, "float16", False),
    # qkv (3 parts of unequal sizes, one 128-output block straddling all three), rank 8 padded to
    # 16: decode rows of 4 adapters and the base interleaved over 3 tiles, T not a multiple of 16
    ([i % 5 for i in range(37)], 5, 8, [40, 24, 24], 64, "float32", False),
    ([i % 5 for i in range(37)], 5, 8, [40, 24, 24], 64, "float32", True),  # the same, rows sorted by slot
    # gate/up (2 parts, the 2nd 128-block straddles them): a prefill's run of one adapter across
    # tile boundaries between base rows and another adapter's run
    ([0] * 5 + [3] * 50 + [1] * 20 + [0] * 3, 4, 16, [160, 160], 80, "float16", True),
    ([0] * 5 + [3] * 50 + [1] * 20 + [0] * 3, 4, 16, [160, 160], 80, "float32", False),
    # qkv with whole blocks inside part 0 and one block straddling parts 1 and 2
    ([3, 0, 1, 3, 3, 2, 0, 1, 1, 1, 2, 3, 0, 0, 2, 1, 3, 2, 2, 1], 4, 16, [256, 64, 64], 48, "float32", True),
    ([2], 3, 16, [64], 64, "float32", False),  # T = 1
    ([1], 2, 16, [32, 32], 64, "float16", True),  # T = 1, two parts
    ([0], 2, 16, [48, 16, 16], 32, "float32", True),  # T = 1, the base
    ([1, 2, 0, 2, 1, 1, 0, 2, 2] * 3, 3, 64, [100], 200, "float16", True),  # rank 64, one part
    # the shrink splitting K (partial sums added by the expand): 4 splits of 256, 2 uneven ones
    ([i % 4 for i in range(37)], 4, 16, [64, 32, 32], 1024, "float32", True),
    ([0, 2, 1, 1, 2, 2, 0, 1, 2, 1], 3, 8, [48, 48], 600, "float16", False),
    # a 4200-row step (64-row tiles): two prefills, then decode rows of both and the base
    ([0] * 100 + [1] * 1500 + [2] * 1000 + [i % 3 for i in range(1600)], 3, 8, [64, 64], 32, "float32", True),
]


def engine_case() -> bool:
    """The whole engine with the kernels in the layers (as on CUDA), on a tiny Llama with two
    adapters and the base in one batch: greedy tokens equal peft's merged model."""
    import tempfile

    import loom.worker.worker as worker_module
    from helpers.lora_adapters import greedy_tokens, merged_model, save_peft_adapter
    from helpers.tiny_models import save_tiny_model
    from loom.config import EngineConfig
    from loom.engine.llm_engine import LLMEngine
    from loom.engine.types import EngineRequest, SamplingParams, StoppingParams
    from loom_plugins.lora.sgmv_triton import lora_shrink_expand

    worker_module._lora_kernel = lambda device: lora_shrink_expand  # type: ignore[assignment]
    with tempfile.TemporaryDirectory() as tmp:
        base = save_tiny_model("llama", Path(tmp) / "base")
        adapters = {"x": save_peft_adapter(base, Path(tmp) / "x", r=4, targets=("q_proj", "k_proj", "v_proj",
                                                                                  "o_proj"), seed=1),
                    "y": save_peft_adapter(base, Path(tmp) / "y", r=8, targets=("gate_proj", "up_proj", "down_proj"),
                                           use_rslora=True, seed=2)}
        prompts = {"x": (5, 9, 33, 7, 81), "y": (40, 41, 42, 17), "": (60, 61, 70, 5, 5, 9)}
        expected = {n: greedy_tokens(merged_model(base, adapters.get(n)), p, 5) for n, p in prompts.items()}
        engine = LLMEngine(EngineConfig(model_id=str(base), block_size=4, warmup=False, max_batch_total_tokens=256,
                                        lora_adapters=tuple((n, str(p)) for n, p in adapters.items())))
        assert engine.worker.lora is not None and engine.worker.lora.kernel is lora_shrink_expand
        for n, p in prompts.items():
            engine.add_request(EngineRequest(f"r{n}", p, SamplingParams(), StoppingParams(max_new_tokens=5,
                                                                                          ignore_eos=True),
                                             adapter_id=n))
        got: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                got.setdefault(out.request_id[1:], []).extend(out.token_ids)
    ok = got == expected and expected["x"] != expected[""] and expected["y"] != expected[""]
    print(f"{'ok' if ok else 'FAIL'} engine case: kernels in the layers, two adapters and the base: {got} vs {expected}")
    return ok


def main() -> int:
    _setup()
    import torch

    from loom.lora.layers import LoraBatch, LoraLayerWeights, lora_batch
    from loom_plugins.lora.sgmv_triton import lora_shrink_expand

    failed = 0
    for i, (slots, num_slots, rank, parts, k, dtype_name, ordered) in enumerate(CASES):
        dtype = getattr(torch, dtype_name)
        gen = torch.Generator().manual_seed(i)
        n, width = sum(parts), len(parts) * rank
        # The tables as LoraSlots writes them: part p's A in rows p*R : p*R + r, its scaled B in
        # its own output rows and columns p*R : p*R + r, zeros elsewhere in the block diagonal.
        # The kernels' copy has NaN outside the diagonal blocks: the expand reads only each
        # output's own part's columns (the old cases, called without parts, have zeros there).
        layer = LoraLayerWeights(num_slots, rank, k, parts, dtype, torch.device("cpu"))
        ref = LoraLayerWeights(num_slots, rank, k, parts, torch.float32, torch.device("cpu"))
        for s in range(1, num_slots):
            a, b = torch.zeros(width, k), torch.zeros(n, width)
            for p, (lo, size) in enumerate(zip(layer.part_offsets, parts, strict=True)):
                r = max(1, rank - 4 * ((s + p) % 2))  # ranks below the max rank: padded columns
                a[p * rank : p * rank + r] = torch.randn(r, k, generator=gen) * 0.2
                b[lo : lo + size, p * rank : p * rank + r] = torch.randn(size, r, generator=gen) * 0.2
            a, b = a.to(dtype), b.to(dtype)
            ref.write(s, a.float(), b.float())
            if i >= 4:
                diagonal = torch.zeros(n, width, dtype=torch.bool)
                for p, (lo, size) in enumerate(zip(layer.part_offsets, parts, strict=True)):
                    diagonal[lo : lo + size, p * rank : (p + 1) * rank] = True
                b = b.masked_fill(~diagonal, float("nan"))
            layer.write(s, a, b)
        x = torch.randn(len(slots), k, generator=gen).to(dtype)
        base = torch.randn(len(slots), n, generator=gen).to(dtype)
        token_slots = torch.tensor(slots, dtype=torch.int32)
        rows = [(s, (token_slots == s).nonzero().squeeze(1)) for s in sorted(set(slots)) if s]
        # The torch path in float32 (a float32 copy of the tables for the fp16 case).
        with lora_batch(LoraBatch(token_slots, rows)):
            expected = ref.add_to(x.float(), base.float().clone())
        got = base.clone()
        if ordered:
            layer.kernel = lora_shrink_expand
            with lora_batch(LoraBatch(token_slots, [], use_kernel=True)):
                layer.add_to(x, got)
        elif i >= 4:
            lora_shrink_expand(x, layer.a, layer.b, token_slots, got, parts=parts)
        else:
            lora_shrink_expand(x, layer.a, layer.b, token_slots, got)
        base_rows = token_slots == 0
        same_base = torch.equal(got[base_rows], base[base_rows])
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        close = torch.allclose(got.float(), expected.float(), atol=tol, rtol=tol)
        err = (got.float() - expected.float()).abs().max().item()
        ok = same_base and close
        failed += not ok
        print(f"{'ok' if ok else 'FAIL'} case {i}: T={len(slots)} slots={sorted(set(slots))} R={rank} parts={parts} "
              f"in={k} {dtype_name} {'sorted by slot' if ordered else 'unordered'} max err {err:.2e} "
              f"base rows untouched {same_base}")
    failed += not engine_case()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
