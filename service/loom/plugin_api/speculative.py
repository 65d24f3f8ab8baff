"""The speculative proposer contract: what a ``loom_speculative_decoders`` plugin's ``load()``
returns.

A proposer guesses the next few tokens of each running sequence cheaply (an n-gram lookup in the
context, a small draft model, extra heads on the target model). The engine then scores each
sequence's last token and its ``k`` drafts in one step of ``k + 1`` query rows (CUDA graphs are
captured for that query length), the sampler accepts a prefix of the drafts by rejection
sampling so that the output distribution is exactly the target model's, and the output
processor applies the accepted tokens (plus the one the target model chose after them) as one
list per sequence. A proposer never sees the engine's sequences or the batch bookkeeping:
only the plain :class:`DraftRequest` rows below.

This module needs no torch: a proposer that runs a model builds it from
:class:`ProposerContext` (device and dtype names, the target's vocabulary) itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer is built with."""

    num_speculative_tokens: int  # k: at most this many drafts per sequence and step
    vocab_size: int  # the target model's: drafts must be ids below it
    device: str  # "cpu", "cuda", "cuda:1", ...
    dtype: str  # "float32", "bfloat16", ...
    options: dict[str, str]  # the plugin's own settings (e.g. a draft model's path), from the command line
    # the engine's longest sequence (prompt and output): a draft model sizes its CUDA graphs' block
    # tables by it; 0 when unknown
    max_model_len: int = 0
    max_batch_size: int = 0  # the most sequences a propose call holds (0: unknown)


@dataclass(frozen=True)
class DraftRequest:
    """One running sequence that may get drafts this step."""

    seq_id: int  # stable for the sequence's life; ``release`` is called with it at the end
    token_ids: Sequence[int]  # prompt then output so far, every token known on the host
    max_drafts: int  # <= k: fewer near max_new_tokens or the model's length


class Proposer(ABC):
    """Drafts for a batch of sequences; stateless or keyed by ``seq_id``."""

    name: str = ""

    def __init__(self, context: ProposerContext) -> None:
        self.check_options(context.options)
        self.context = context

    @classmethod
    def check_options(cls, options: dict[str, str]) -> None:
        """Raise ValueError (one sentence naming the option) for options this proposer does not
        take or values it cannot use; called before the model loads. Default: takes none."""
        if options:
            raise ValueError(f"takes no options, got {sorted(options)}")

    @abstractmethod
    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Drafts per request, in order: each a list of at most ``max_drafts`` token ids (empty:
        no guess for that sequence this step; it decodes one token as usual)."""

    def accepted(self, seq_id: int, num_drafts: int, num_accepted: int) -> None:  # noqa: B027
        """How many of the drafts proposed for ``seq_id`` the target model accepted (for
        proposers that adapt, and for the acceptance-rate metric). Default: nothing."""

    def release(self, seq_id: int) -> None:  # noqa: B027
        """``seq_id`` has finished or was aborted: drop any state kept for it. Default: nothing."""
