"""A speculative proposer for tests: it knows the answer (what a run without drafts produced)
and lies on purpose, so tests control how many drafts are right."""

from __future__ import annotations

import random
from collections.abc import Sequence

from loom.plugin_api import DraftRequest, PluginRegistry, Proposer, SpeculativeDecoderSpec, hookimpl

REFERENCE: dict[tuple[int, ...], list[int]] = {}  # prompt -> the tokens a run without drafts made
LIES = {"rate": 0.0}


class OracleProposer(Proposer):
    """Drafts the reference continuation, each token replaced by a wrong one with probability
    ``LIES['rate']`` (deterministic per position), and sometimes fewer than asked."""

    name = "oracle"

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        out = []
        for r in requests:
            tokens = tuple(r.token_ids)
            guess: list[int] = []
            for prompt, ref in REFERENCE.items():
                if tokens[: len(prompt)] == prompt:
                    done = len(tokens) - len(prompt)
                    rng = random.Random(hash((prompt, done)))
                    guess = list(ref[done : done + rng.randint(1, r.max_drafts)])
                    guess = [t if rng.random() >= LIES["rate"] else (t + 1) % 200 for t in guess]
            out.append(guess)
        return out


class _OraclePlugin:
    @hookimpl
    def loom_speculative_decoders(self) -> list[SpeculativeDecoderSpec]:
        return [SpeculativeDecoderSpec(name="oracle", summary="test", load=lambda: OracleProposer)]


def registry() -> PluginRegistry:
    import loom_plugins.attention
    import loom_plugins.models
    import loom_plugins.speculative

    registry = PluginRegistry()
    registry.register(loom_plugins.models, "loom-models", "loom-server")
    registry.register(loom_plugins.attention, "loom-attention", "loom-server")
    registry.register(loom_plugins.speculative, "loom-speculative", "loom-server")
    registry.register(_OraclePlugin(), "oracle", "tests")
    return registry
