"""The contract quantizer plugins implement, and how the loader picks one.

A quantizer's ``QuantizerSpec.load()`` returns a class following :class:`Quantizer`. Once the
model is built and its checkpoint loaded, the quantizer replaces linear layers by its own
modules (same input and output shapes); the model's forward is unchanged. A model's logits
projection is its ``lm_head`` attribute (None when tied to the input embedding), so a quantizer
may give a tied model a quantized head of its own.

``--quantize``: ``auto`` applies a quantizer whose format the checkpoint itself carries (a GGUF
file's blocks on the CPU), when it can run here, and otherwise keeps the dense weights; ``none``
keeps them always; a name applies that quantizer or fails saying why it cannot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
from torch import nn


class QuantizationError(Exception):
    """A quantizer cannot serve this model here; the message says why."""


class Quantizer(Protocol):
    """What a quantizer plugin's class provides. One instance quantizes one loaded model."""

    @classmethod
    def for_checkpoint(cls, model_dir: Path) -> bool:
        """True when the checkpoint carries weights in this quantizer's own format."""
        ...

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> None:
        """Raises QuantizationError when it cannot serve this model on ``device`` in ``dtype``."""
        ...

    def quantize(self, model: nn.Module) -> int:
        """Replace the model's linear layers it can serve; returns how many it replaced."""
        ...
