"""L1, LoRA adapters (../shared/bench/WORKLOADS.md): W2's requests spread round-robin over 8
random adapters of rank 16 (q, k, v, o, gate, up, down) and the base model, against the same
requests on the base model alone (an engine without LoRA). The target is >= 0.8x.

The adapters are written as PEFT directories (adapter_config.json + adapter_model.safetensors)
with random factors shaped for the model, so no PEFT install or download is needed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from loom.config import EngineConfig

from .workloads import Workload

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(model_dir: Path, out: Path, rank: int = 16, seed: int = 0, scale: float = 0.01) -> Path:
    """A PEFT LoRA directory for ``model_dir``'s Llama-shaped layers, random A and B factors."""
    from safetensors.torch import save_file

    from loom.model_loader import load_hf_config, model_dims

    config = load_hf_config(model_dir)
    dims = model_dims(config)
    hidden, inter = int(config.hidden_size), int(config.intermediate_size)
    q, kv = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(dims.num_layers):
        for name, (fan_in, fan_out) in shapes.items():
            part = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * scale
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
        "use_rslora": False, "bias": "none", "task_type": "CAUSAL_LM"}))
    return out


def run_l1(cfg: EngineConfig, w2: Workload, num_adapters: int = 8, rank: int = 16) -> dict[str, Any]:
    """W2 on the base model alone, then spread over ``num_adapters`` adapters and the base."""
    from loom.model_loader import resolve_model_dir

    from .command import _run_loom

    model_dir = resolve_model_dir(cfg.model_id)
    with tempfile.TemporaryDirectory(prefix="loom-l1-") as tmp:
        names = [f"l1-{i}" for i in range(num_adapters)]
        paths = [write_random_adapter(model_dir, Path(tmp) / n, rank, seed=i) for i, n in enumerate(names)]
        base_figures, _ = asyncio.run(_run_loom(cfg, [w2], full_warmup=True))
        lora_cfg = dataclasses.replace(cfg, lora_adapters=tuple(zip(names, map(str, paths), strict=True)),
                                       max_loras=num_adapters, max_lora_rank=rank)
        spread = [*names, ""]  # request i: adapter i % 9, the last the base model
        lora_figures, info = asyncio.run(_run_loom(lora_cfg, [w2], full_warmup=True, adapters=spread))
    base, lora = base_figures[w2.name], lora_figures[w2.name]
    return {"description": f"{w2.description}, round-robin over {num_adapters} rank-{rank} adapters "
                           f"({', '.join(TARGETS)}) and the base model",
            "base_alone": base, "adapters": lora, "ratio": lora["out_tok_s"] / base["out_tok_s"],
            "target_ratio": 0.8, "engine_config": dataclasses.asdict(lora_cfg), "engine": info}
