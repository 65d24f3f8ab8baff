"""The acceptance rule of loom.sample.verify against the target distribution, by counting.

For a one-hot draft d, rejection sampling must emit each token t with the target's probability
p(t): accept d with probability p(d), otherwise draw from p without d. Loom's rule (accept when
the token the sampler draws at that position, with the request's counter-based noise, equals d)
is checked on 40,000 seeds over an 8-token vocabulary: the emitted distribution is within a
total-variation distance of 0.015 of p, and d is accepted with probability p(d). A classic
wrong rule (on rejection, draw again from p itself) fails the same bound, so the check can fail.
"""

from __future__ import annotations

import torch

from loom.sample.batch import SAMPLE, SamplingPlan, build_sampling_batch
from loom.sample.noise import counter_uniform, i64
from loom.sample.sampler import Sampler
from loom.sample.verify import accepted_prefix

V, N = 8, 40_000
LOGITS = torch.tensor([1.2, 0.3, -0.5, 2.0, 0.0, -1.0, 0.8, 0.1])
TEMPERATURE = 0.9
DRAFT = 6  # p(6) is about 0.14


def _target() -> torch.Tensor:
    return torch.softmax(LOGITS / TEMPERATURE, -1)


def _sampled(step: int = 0) -> torch.Tensor:
    """The token the sampler draws at output position ``step`` for seeds 0..N-1: [N]."""
    plan = SamplingPlan(floats=[(TEMPERATURE, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0)] * N,
                        ints=[(V, i64(seed), step) for seed in range(N)], flags=SAMPLE, banned=[], top_n=[0] * N)
    batch = build_sampling_batch(plan, V, torch.device("cpu"))
    return Sampler()(LOGITS.expand(N, V).clone(), batch).token_ids


def _tv(tokens: torch.Tensor, p: torch.Tensor) -> float:
    freq = torch.bincount(tokens, minlength=V).double() / tokens.numel()
    return 0.5 * float((freq - p.double()).abs().sum())


def test_loom_rule_emits_the_target_distribution() -> None:
    p = _target()
    chosen = _sampled()
    accepted = torch.tensor([accepted_prefix([int(t)], [DRAFT]) for t in chosen])
    emitted = torch.where(accepted.bool(), torch.full_like(chosen, DRAFT), chosen)  # d when accepted, else the correction
    assert _tv(emitted, p) < 0.015
    assert abs(float(accepted.double().mean()) - float(p[DRAFT])) < 0.01  # P(accept d) = p(d)
    # a rejection's correction is p without d, renormalised: (p - q)+ / (1 - p(d))
    rejected = emitted[~accepted.bool()]
    residual = p.clone()
    residual[DRAFT] = 0
    assert _tv(rejected, residual / residual.sum()) < 0.015


def test_a_wrong_rule_fails_the_same_check() -> None:
    """Accept d with probability p(d) (an independent uniform), but on rejection draw from p
    itself (d may come out again): d is over-weighted, and the bound catches it."""
    p = _target()
    chosen = _sampled()  # a draw from p per seed (the 'redraw')
    u = counter_uniform(torch.arange(N, dtype=torch.int64), torch.full((N,), 10**6, dtype=torch.int64), 1)[:, 0]
    accept = u < p[DRAFT]
    emitted = torch.where(accept, torch.full_like(chosen, DRAFT), chosen)
    assert _tv(emitted, p) > 0.05


def test_each_position_has_its_own_noise() -> None:
    """The second row of a verification (output position 1) draws independently of the first:
    over seeds, the pair of tokens is distributed as p x p (the target's own when its context
    is fixed, as it is here)."""
    p = _target()
    first, second = _sampled(0), _sampled(1)
    pairs = first * V + second
    joint = torch.outer(p, p).reshape(-1)
    freq = torch.bincount(pairs, minlength=V * V).double() / N
    assert 0.5 * float((freq - joint.double()).abs().sum()) < 0.04
