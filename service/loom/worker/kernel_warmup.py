"""The token counts at which a model runs before serving, so that no GPU kernel compiles after.

Most of a step's kernels compile once whatever the step's size: cuBLAS chooses at run time, and
Loom's Triton kernels take the number of rows as a grid size or an argument they are not
specialised on. A few choose a variant by the number of rows: the W4A16 GEMM tiles by
token-count bucket and splits K by the tiles it has, and Triton compiles again for each class
of an integer argument (the value 1, a multiple of 16, other). Each compile costs a second or
more on the H200; in the middle of serving it stalls every running request (W5 b lost half of
its first timed run to them: docs/speculative.md).

Each linear layer's method says which counts cover its variants
(``LinearMethod.warm_up_token_counts``). The decoder layers see every row of a step, the logits
head only the sampled rows: the two lists are kept apart, so that a warm-up can sample as many
rows as the head needs without running that many tokens through the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from loom.layers.embed_head import ParallelLMHead
from loom.plugin_api.quantization import LinearMethod


@dataclass(frozen=True)
class WarmUpCounts:
    """Token counts a warm-up runs (ascending; empty: nothing depends on the count)."""

    body: tuple[int, ...] = ()  # rows through the decoder layers: a step's tokens
    head: tuple[int, ...] = ()  # rows through the logits head: a step's sampled rows


def warm_up_counts(model: nn.Module, max_tokens: int, max_rows: int) -> WarmUpCounts:
    """The union over the model's linear layers of the counts their methods ask for: up to
    ``max_tokens`` rows a step through the decoder layers, ``max_rows`` sampled rows through the
    head."""
    body: set[int] = set()
    head: set[int] = set()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, LinearMethod):
            continue
        if isinstance(module, ParallelLMHead):
            head.update(method.warm_up_token_counts(module, max_rows))
        else:
            body.update(method.warm_up_token_counts(module, max_tokens))
    return WarmUpCounts(tuple(sorted(body)), tuple(sorted(head)))
