"""The calibration text ``loom quantize`` runs GPTQ and AWQ on: chapters of the Jargon File (public
domain) shipped as package data, so no data set is downloaded."""

from __future__ import annotations

from importlib import resources
from typing import Any

import torch

CALIBRATION_FILE = "calibration.txt"


def calibration_text() -> str:
    return (resources.files("loom_plugins.quant") / "data" / CALIBRATION_FILE).read_text(encoding="utf-8")


def calibration_windows(tokenizer: Any, samples: int, seq_len: int, vocab_size: int) -> torch.Tensor:
    """``[samples, seq_len]`` token ids: consecutive windows of the tokenized text (fewer when the
    text is shorter). Ids the model does not know (a random model's word-level vocabulary) are
    folded into its range so the shapes still work."""
    ids = tokenizer.encode(calibration_text())
    ids = [i % vocab_size for i in ids]
    count = min(samples, len(ids) // seq_len)
    if count < 1:
        raise ValueError(f"the calibration text has {len(ids)} tokens, fewer than one window of {seq_len}")
    return torch.tensor(ids[:count * seq_len], dtype=torch.long).view(count, seq_len)
