"""Verification of drafts: which of a sequence's draft tokens the target model accepts.

A sequence verifying m drafts ``d_1..d_m`` gets m + 1 rows in one forward: row j scores the
position after input j (its last token, then the drafts). The sampler draws, at every row, the
token the target would choose there if ``d_1..d_j`` were already its output: the processed
distribution p_j (penalties, temperature, top-k / top-p / typical-p / min-p) and the counter-
based Gumbel noise of that output position (``loom.sample.noise``: a hash of the seed, the
output position and the token id). Draft ``d_{j+1}`` is accepted when it equals row j's token;
the first row whose token differs gives the correction, and when every draft is accepted row m
gives the bonus token.

This is rejection sampling for drafts with a one-hot proposal q (every proposer Loom ships:
n-gram lookup, and a greedy draft model): accepting d with probability min(1, p(d) / q(d)) =
p(d) and, on rejection, sampling from (p - q)+ normalised = p restricted to the other tokens.
The Gumbel-max token equals d with probability exactly p(d), and given that it is not d it is
distributed as p over the other tokens, so the rule holds, with two properties a separate
uniform draw would not give:

- the output is the very sequence of tokens the same request produces without speculation
  (greedy and seeded alike): a request's output does not depend on what it was speculated by;
- nothing is drawn that depends on the batch, so seeded requests stay batch-invariant.

``tests/unit/test_speculative_sampling.py`` checks the distribution of accepted tokens against
the target's on a small vocabulary, and that a wrong rule fails the same check.
"""

from __future__ import annotations

from collections.abc import Sequence


def accepted_prefix(chosen: Sequence[int], drafts: Sequence[int]) -> int:
    """How many drafts are accepted: the length of the common prefix of the tokens the target
    chose at each row (``len(drafts) + 1`` of them) and the drafts."""
    n = 0
    for target, draft in zip(chosen, drafts, strict=False):
        if target != draft:
            break
        n += 1
    return n
