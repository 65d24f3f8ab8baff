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


# (rows' slots, slots S, rank width W, in, out, dtype)
CASES = [
    ([0, 1, 1, 2, 0, 3, 3, 3], 4, 16, 64, 96, "float32"),  # a mixed step: base, prefill and decode rows
    ([2, 2, 2, 2], 3, 48, 130, 70, "float32"),  # one adapter, sizes off the block sizes
    ([0, 0, 0], 2, 8, 64, 64, "float32"),  # only base rows: nothing changes
    ([1, 0, 2, 1, 2], 3, 32, 96, 200, "float16"),
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
    for i, (slots, num_slots, width, k, n, dtype_name) in enumerate(CASES):
        dtype = getattr(torch, dtype_name)
        gen = torch.Generator().manual_seed(i)
        layer = LoraLayerWeights(num_slots, width, k, [n], dtype, torch.device("cpu"))
        for s in range(1, num_slots):
            layer.write(s, (torch.randn(width, k, generator=gen) * 0.2).to(dtype),
                        (torch.randn(n, width, generator=gen) * 0.2).to(dtype))
        x = torch.randn(len(slots), k, generator=gen).to(dtype)
        base = torch.randn(len(slots), n, generator=gen).to(dtype)
        token_slots = torch.tensor(slots, dtype=torch.int32)
        rows = [(s, (token_slots == s).nonzero().squeeze(1)) for s in sorted(set(slots)) if s]
        # The torch path in float32 (a float32 copy of the tables for the fp16 case).
        ref = LoraLayerWeights(num_slots, width, k, [n], torch.float32, torch.device("cpu"))
        for s in range(1, num_slots):
            ref.write(s, layer.a[s].float(), layer.b[s].float())
        with lora_batch(LoraBatch(token_slots, rows)):
            expected = ref.add_to(x.float(), base.float().clone())
        got = base.clone()
        lora_shrink_expand(x, layer.a, layer.b, token_slots, got)
        base_rows = token_slots == 0
        same_base = torch.equal(got[base_rows], base[base_rows])
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        close = torch.allclose(got.float(), expected.float(), atol=tol, rtol=tol)
        err = (got.float() - expected.float()).abs().max().item()
        ok = same_base and close
        failed += not ok
        print(f"{'ok' if ok else 'FAIL'} case {i}: slots={slots} W={width} in={k} out={n} {dtype_name} "
              f"max err {err:.2e} base rows untouched {same_base}")
    failed += not engine_case()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
