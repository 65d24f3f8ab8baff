"""LoRA adapters made with peft on a saved Hugging Face model, and the merged model's greedy
tokens (the reference Loom's batched adapters must reproduce)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


def save_peft_adapter(base_dir: Path, out_dir: Path, *, r: int = 8, alpha: float = 16,
                      targets: Sequence[str] = ("q_proj", "v_proj"), use_rslora: bool = False,
                      seed: int = 0, scale: float = 0.2) -> Path:
    """A LoRA adapter of ``base_dir`` saved by peft to ``out_dir``, with random (seeded) A and B
    factors of standard deviation ``scale`` (peft's own init leaves B zero: no effect to test)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora,
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    model.save_pretrained(out_dir)
    return out_dir


def merged_model(base_dir: Path, adapter_dir: Path | None) -> Any:
    """The base model with the adapter merged into its weights (fp32, eager attention)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager")
    if adapter_dir is None:
        return base.eval()
    from peft import PeftModel

    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()


def greedy_tokens(model: Any, prompt: Sequence[int], new_tokens: int) -> list[int]:
    """Argmax decoding, EOS ignored, with the KV cache of transformers."""
    ids = torch.tensor([list(prompt)])
    out: list[int] = []
    past = None
    with torch.no_grad():
        for _ in range(new_tokens):
            res = model(ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.tensor([[nxt]])
    return out
