"""The batched sampler against transformers' logits processors, row by row, in one batch."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from loom.engine.sequence import Sequence
from loom.engine.step_planner import sampling_plan
from loom.engine.types import EngineRequest, SamplingParams, StoppingParams
from loom.sample.batch import SamplingBatch
from loom.sample.batch import build_sampling_batch as build_from_plan
from loom.sample.noise import counter_uniform
from loom.sample.processors import Suppression, apply_processors
from loom.sample.sampler import Sampler

V = 64


def seq(sp: SamplingParams, prompt: tuple[int, ...] = (1, 2, 3), out: tuple[int, ...] = (),
        stopping: StoppingParams | None = None) -> Sequence:
    s = Sequence(EngineRequest("r", prompt, sp, stopping or StoppingParams()), 0, sp.seed)
    s.token_ids.extend(out)
    return s


def build_sampling_batch(seqs: list[Sequence], vocab: int, device: torch.device,
                         eos_token_ids: tuple[int, ...] = ()) -> SamplingBatch:
    """The engine's way: the core plans the rows from its sequences, the worker builds tensors."""
    return build_from_plan(sampling_plan(seqs, vocab, eos_token_ids), vocab, device)


def hf_logprobs(logits: torch.Tensor, *procs: object, ids: torch.Tensor | None = None) -> torch.Tensor:
    x = logits[None].clone()
    for p in procs:
        x = p(ids if ids is not None else torch.zeros(1, 1, dtype=torch.long), x)  # type: ignore[operator]
    return x.log_softmax(-1)[0]


CASES = [
    (SamplingParams(do_sample=True, temperature=0.7), [TemperatureLogitsWarper(0.7)]),
    (SamplingParams(do_sample=True, top_k=5), [TopKLogitsWarper(5)]),
    (SamplingParams(do_sample=True, top_p=0.8), [TopPLogitsWarper(0.8)]),
    (SamplingParams(do_sample=True, typical_p=0.6), [TypicalLogitsWarper(0.6)]),
    (SamplingParams(do_sample=True, min_p=0.1), [MinPLogitsWarper(0.1)]),
    (SamplingParams(do_sample=True, temperature=1.3, top_k=20, top_p=0.9),
     [TemperatureLogitsWarper(1.3), TopKLogitsWarper(20), TopPLogitsWarper(0.9)]),
    (SamplingParams(), []),
]


def test_warpers_match_transformers_in_one_heterogeneous_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(len(CASES), V) * 3
    seqs = [seq(sp) for sp, _ in CASES]
    b = build_sampling_batch(seqs, V, torch.device("cpu"))
    ours = apply_processors(apply_processors(logits, b.processors), b.filters)
    ours = torch.where(b.do_sample[:, None], ours, logits).log_softmax(-1)
    for i, (_, procs) in enumerate(CASES):
        ref = hf_logprobs(logits[i], *procs)
        kept = ref > -1e30
        assert torch.equal(kept, ours[i] > -1e30), f"row {i}: different tokens kept"
        assert torch.allclose(ours[i][kept], ref[kept], atol=1e-5), f"row {i}"


# Each filter, with and without temperature, top_n 5 (top_k=2 keeps fewer than that), and a
# greedy row: (params, the processors of the reported distribution, the filters after them).
FILTERED: list[tuple[SamplingParams, list[object], list[object]]] = [
    (SamplingParams(do_sample=True, top_k=2, seed=1, top_n_tokens=5), [], [TopKLogitsWarper(2)]),
    (SamplingParams(do_sample=True, temperature=0.7, top_p=0.8, seed=2, top_n_tokens=5),
     [TemperatureLogitsWarper(0.7)], [TopPLogitsWarper(0.8)]),
    (SamplingParams(do_sample=True, temperature=1.3, typical_p=0.6, seed=3, top_n_tokens=5),
     [TemperatureLogitsWarper(1.3)], [TypicalLogitsWarper(0.6)]),
    (SamplingParams(do_sample=True, temperature=0.5, min_p=0.1, seed=4, top_n_tokens=5),
     [TemperatureLogitsWarper(0.5)], [MinPLogitsWarper(0.1)]),
    (SamplingParams(do_sample=True, top_k=20, top_p=0.9, seed=5, top_n_tokens=5), [],
     [TopKLogitsWarper(20), TopPLogitsWarper(0.9)]),
    (SamplingParams(top_n_tokens=5), [], []),
]


def test_logprobs_are_reported_before_filtering_and_alternatives_were_kept() -> None:
    torch.manual_seed(5)
    logits = torch.randn(len(FILTERED), V) * 3
    b = build_sampling_batch([seq(sp) for sp, _, _ in FILTERED], V, torch.device("cpu"))
    out = Sampler()(logits, b)
    assert out.top_ids is not None and out.top_logprobs is not None
    for i, (sp, reported_procs, filters) in enumerate(FILTERED):
        reported = hf_logprobs(logits[i], *reported_procs)  # after temperature, before filtering
        kept = hf_logprobs(logits[i], *reported_procs, *filters) > float("-inf")
        token = int(out.token_ids[i])
        assert kept[token], f"row {i}: drawn from outside the filtered distribution"
        assert out.logprobs[i].item() == pytest.approx(reported[token].item(), abs=1e-5), f"row {i}"
        # the most likely kept tokens, fewer than asked when fewer were kept
        order = [t for t in reported.argsort(descending=True).tolist() if kept[t]][: sp.top_n_tokens]
        listed = [(t, lp) for t, lp in zip(out.top_ids[i].tolist(), out.top_logprobs[i].tolist(), strict=True)
                  if lp != float("-inf")]
        assert [t for t, _ in listed] == order, f"row {i}"
        assert [lp for _, lp in listed] == pytest.approx(reported[order].tolist(), abs=1e-5), f"row {i}"
    assert sum(lp == float("-inf") for lp in out.top_logprobs[0].tolist()) == 3  # top_k=2 of 5 slots


def test_repetition_penalty_matches_transformers() -> None:
    torch.manual_seed(1)
    logits = torch.randn(2, V) * 2
    prompt, out = (3, 4, 5), (9, 3)
    seqs = [seq(SamplingParams(repetition_penalty=1.3), prompt, out), seq(SamplingParams(), prompt, out)]
    b = build_sampling_batch(seqs, V, torch.device("cpu"))
    ours = apply_processors(logits, b.processors)
    ids = torch.tensor([list(prompt + out)])
    ref = RepetitionPenaltyLogitsProcessor(1.3)(ids, logits[:1].clone())
    assert torch.allclose(ours[0], ref[0])
    assert torch.equal(ours[1], logits[1])  # the other row untouched


def test_frequency_and_presence_penalties_count_output_tokens() -> None:
    logits = torch.zeros(1, V)
    s = seq(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), (7, 7), (9, 9, 9, 11))
    b = build_sampling_batch([s], V, torch.device("cpu"))
    out = apply_processors(logits, b.processors)[0]
    assert out[9].item() == pytest.approx(-(0.5 * 3 + 0.25))
    assert out[11].item() == pytest.approx(-(0.5 + 0.25))
    assert out[7].item() == 0.0  # prompt tokens are not penalised by these two


def test_min_new_tokens_suppresses_eos() -> None:
    logits = torch.zeros(1, V)
    logits[0, 2] = 10.0  # EOS would win
    s = seq(SamplingParams(), stopping=StoppingParams(min_new_tokens=2, stop_token_ids=(5,)))
    b = build_sampling_batch([s], V, torch.device("cpu"), eos_token_ids=(2,))
    out = Sampler()(logits, b)
    assert out.token_ids.item() != 2
    assert torch.isinf(apply_processors(logits, b.processors)[0, 5])


def test_greedy_rows_take_argmax_and_report_logprob() -> None:
    torch.manual_seed(2)
    logits = torch.randn(3, V)
    b = build_sampling_batch([seq(SamplingParams()) for _ in range(3)], V, torch.device("cpu"))
    out = Sampler()(logits, b)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert torch.allclose(out.logprobs, logits.log_softmax(-1).max(-1).values)


def test_seeded_sampling_is_batch_invariant() -> None:
    torch.manual_seed(3)
    logits = torch.randn(4, V)
    sp = SamplingParams(do_sample=True, seed=1234, top_k=30)
    alone = Sampler()(logits[:1], build_sampling_batch([seq(sp)], V, torch.device("cpu")))
    others = [seq(SamplingParams(do_sample=True, seed=s)) for s in (1, 2)] + [seq(SamplingParams())]
    batch_seqs = [*others[:2], seq(sp), others[2]]
    mixed = Sampler()(logits[[1, 2, 0, 3]], build_sampling_batch(batch_seqs, V, torch.device("cpu")))
    assert mixed.token_ids[2] == alone.token_ids[0]


def test_counter_uniform_is_deterministic_and_uniform() -> None:
    seeds = torch.tensor([5, 5, 6])
    steps = torch.tensor([0, 0, 0])
    u = counter_uniform(seeds, steps, 20000)
    assert torch.equal(u[0], u[1])
    assert not torch.equal(u[0], u[2])
    assert u.min() > 0.0 and u.max() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.01
    # different steps give different draws
    assert not torch.equal(u[0], counter_uniform(seeds[:1], torch.tensor([1]), 20000)[0])


def test_a_uniform_that_rounds_up_to_one_never_draws_a_filtered_token() -> None:
    """Uniforms within 2**-25 of 1 (one token id in 2**25, so one row in ~680 of a 49,152-token
    vocabulary) used to round to 1.0 in float32: an infinite Gumbel noise that drew its token
    whatever its probability, filtered out or not. (seed 3, step 10) holds one at id 10947."""
    vocab, seed, step, unlucky = 49152, 3, 10, 10947
    u = counter_uniform(torch.tensor([seed]), torch.tensor([step]), vocab)[0]
    assert u.max() < 1.0
    assert u[unlucky] == u.max()  # still the largest draw: the other draws are unchanged
    logits = torch.zeros(1, vocab)
    logits[0, 5], logits[0, unlucky] = 10.0, -20.0
    s = seq(SamplingParams(do_sample=True, seed=seed, top_k=1))
    s.token_ids.extend([0] * step)  # the output position being sampled is ``step``
    b = build_sampling_batch([s], vocab, torch.device("cpu"))
    assert b.steps.tolist() == [step]
    assert Sampler()(logits, b).token_ids.tolist() == [5]


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2] + [0.0] * (V - 3))
    logits = probs.clamp_min(1e-12).log()[None].repeat(3000, 1)
    seqs = [seq(SamplingParams(do_sample=True, seed=i)) for i in range(3000)]
    out = Sampler()(logits, build_sampling_batch(seqs, V, torch.device("cpu")))
    freq = torch.bincount(out.token_ids, minlength=V)[:3].float() / 3000
    assert torch.allclose(freq, probs[:3], atol=0.04)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_row_is_flagged_and_leaves_the_others_alone(bad: float) -> None:
    torch.manual_seed(4)
    logits = torch.randn(3, V) * 3
    params = [SamplingParams(), SamplingParams(do_sample=True, seed=7, top_p=0.9), SamplingParams(top_n_tokens=3)]
    clean = Sampler()(logits.clone(), build_sampling_batch([seq(p) for p in params], V, torch.device("cpu")))
    poisoned = logits.clone()
    poisoned[1, 5] = bad
    out = Sampler()(poisoned, build_sampling_batch([seq(p) for p in params], V, torch.device("cpu")))
    assert out.finite.tolist() == [True, False, True]
    assert clean.finite.all()
    for i in (0, 2):
        assert out.token_ids[i] == clean.token_ids[i] and out.logprobs[i] == clean.logprobs[i]


def test_penalties_or_temperature_that_overflow_mark_only_their_row() -> None:
    """Finite, positive parameters past what validation accepts can still overflow a logit."""
    torch.manual_seed(6)
    logits = torch.randn(4, V) * 3
    logits[:, 7] = 5.0  # a prompt token with a positive logit: 5 / 1e-38 is past float32
    sane = [SamplingParams(repetition_penalty=1.3, top_n_tokens=3),
            SamplingParams(do_sample=True, seed=8, top_p=0.9, repetition_penalty=1.2, top_n_tokens=3),
            SamplingParams(do_sample=True, seed=9, temperature=0.7, top_n_tokens=3),
            SamplingParams(do_sample=True, seed=10, top_k=5, top_n_tokens=3)]
    overflowing = [SamplingParams(repetition_penalty=1e-38, top_n_tokens=3), sane[1],
                   SamplingParams(do_sample=True, seed=9, temperature=1e-38, top_n_tokens=3), sane[3]]
    clean = Sampler()(logits.clone(), build_sampling_batch([seq(p, (7, 8)) for p in sane], V, torch.device("cpu")))
    out = Sampler()(logits.clone(), build_sampling_batch([seq(p, (7, 8)) for p in overflowing], V,
                                                         torch.device("cpu")))
    assert clean.finite.all()
    assert out.finite.tolist() == [False, True, False, True]
    assert out.top_ids is not None and out.top_logprobs is not None and clean.top_ids is not None
    for i in (1, 3):
        assert out.token_ids[i] == clean.token_ids[i] and out.logprobs[i] == clean.logprobs[i]
        assert torch.equal(out.top_ids[i], clean.top_ids[i]) and torch.equal(out.top_logprobs[i], clean.top_logprobs[i])


def test_a_row_of_minus_infinity_except_one_token_is_finite() -> None:
    logits = torch.full((1, V), float("-inf"))
    logits[0, 9] = 0.0
    out = Sampler()(logits, build_sampling_batch([seq(SamplingParams())], V, torch.device("cpu")))
    assert out.finite.tolist() == [True] and out.token_ids.tolist() == [9] and out.logprobs.tolist() == [0.0]


def penalised(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    return apply_processors(logits, b.processors)


def test_only_the_processors_some_row_needs_are_built() -> None:
    greedy = build_sampling_batch([seq(SamplingParams()) for _ in range(2)], V, torch.device("cpu"))
    assert greedy.processors == [] and greedy.filters == []
    mixed = build_sampling_batch([seq(SamplingParams()), seq(SamplingParams(do_sample=True, top_p=0.9))], V,
                                 torch.device("cpu"))
    assert [type(p).__name__ for p in mixed.processors] == ["Temperature"]
    assert [type(p).__name__ for p in mixed.filters] == ["TopP"]


def test_suppression_bans_each_young_rows_own_ids_and_no_other() -> None:
    """EOS / stop ids before min_new_tokens, as device indices: row 0 is young with stop id 5,
    row 1 is young with stop id 7, row 2 has produced its min_new_tokens already."""
    logits = torch.randn(3, V)
    seqs = [seq(SamplingParams(), stopping=StoppingParams(min_new_tokens=2, stop_token_ids=(5,))),
            seq(SamplingParams(), stopping=StoppingParams(min_new_tokens=1, stop_token_ids=(7, V + 3))),
            seq(SamplingParams(), (1, 2), (4,), stopping=StoppingParams(min_new_tokens=1, stop_token_ids=(5,)))]
    b = build_sampling_batch(seqs, V, torch.device("cpu"), eos_token_ids=(2,))
    (sup,) = b.processors
    assert isinstance(sup, Suppression) and sup.flat_ids.shape == (4,)  # indices, not an [N, V] mask
    out = penalised(logits, b)
    banned = torch.zeros(3, V, dtype=torch.bool)
    banned[0, [2, 5]] = banned[1, [2, 7]] = True
    assert torch.isneginf(out[banned]).all()
    assert torch.equal(out[~banned], logits[~banned])


class BanTokens:
    """A toy processor, as a grammar's token bitmask would be: -inf where ``allowed`` is False."""

    def __init__(self, allowed: torch.Tensor) -> None:
        self.allowed = allowed  # [N, V] bool

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.masked_fill(~self.allowed, float("-inf"))


def test_a_processor_appended_to_the_list_shapes_draws_and_logprobs() -> None:
    """A new processor needs no change to the sampler: append it to the batch's list."""
    torch.manual_seed(7)
    logits = torch.randn(3, V) * 3
    params = [SamplingParams(top_n_tokens=3), SamplingParams(do_sample=True, seed=3, temperature=0.8, top_k=10),
              SamplingParams(do_sample=True, seed=4)]
    allowed = torch.zeros(3, V, dtype=torch.bool)
    allowed[0, [3, 9, 11]] = allowed[1, 20:40] = True
    allowed[2] = True  # row 2 is not constrained
    plain = Sampler()(logits.clone(), build_sampling_batch([seq(p) for p in params], V, torch.device("cpu")))
    b = build_sampling_batch([seq(p) for p in params], V, torch.device("cpu"))
    b.processors.append(BanTokens(allowed))
    out = Sampler()(logits.clone(), b)
    masked = logits.masked_fill(~allowed, float("-inf"))
    assert out.token_ids[0].item() == masked[0].argmax().item()
    assert out.logprobs[0].item() == pytest.approx(masked[0].log_softmax(-1).max().item(), abs=1e-6)
    assert out.top_ids is not None and out.top_logprobs is not None
    assert sorted(out.top_ids[0].tolist()) == [3, 9, 11]
    assert 20 <= out.token_ids[1].item() < 40
    reported = (masked[1] / 0.8).log_softmax(-1)  # after the processors, before top_k
    assert out.logprobs[1].item() == pytest.approx(reported[out.token_ids[1]].item(), abs=1e-5)
    assert out.token_ids[2] == plain.token_ids[2] and out.logprobs[2] == plain.logprobs[2]
