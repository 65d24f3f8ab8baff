"""The Hugging Face transformers peer: ``generate()`` the way a user without Loom runs it."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from .workloads import Workload


def load_peer(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _generate(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, new: int) -> None:
    model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,  # type: ignore[operator]
                   do_sample=False, pad_token_id=0)


@torch.inference_mode()
def run_peer(model: torch.nn.Module, w: Workload, per_batch: int | None = None) -> dict[str, float]:
    """Equal-length workloads run as one batch; mixed ones in left-padded batches of ``per_batch``
    in arrival order, each batch generating its longest request's count. Only the tokens the
    requests asked for count."""
    warm = torch.tensor([w.requests[0][0][:8]])
    _generate(model, warm, torch.ones_like(warm), 2)
    batch = per_batch or len(w.requests)
    start = time.perf_counter()
    for i in range(0, len(w.requests), batch):
        chunk = w.requests[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        _generate(model, ids, mask, max(n for _, n in chunk))
    dt = time.perf_counter() - start
    return {"s": dt, "out_tokens": w.output_tokens, "out_tok_s": w.output_tokens / dt}
