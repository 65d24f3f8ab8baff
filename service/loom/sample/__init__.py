"""Sampling: the counter-based noise, the step's sampling tensors, the logits processors and the
sampler that applies them and draws one token per row."""
