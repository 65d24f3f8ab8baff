"""The one-launch greedy pick (``loom.sample.greedy_triton``) on the CPU, through Triton's
interpreter, against the sampler's torch path.

Run as a script in its own process (``TRITON_INTERPRET`` must be set before the kernels are
defined); ``tests/unit/test_greedy_kernel.py`` runs it. Exits non-zero on a mismatch.

Checked: for rows of 1, 2,047, 2,048, 2,049, 49,152 (SmolLM2) and 151,936 (Qwen3) words, the
tokens equal ``torch.argmax`` (the first maximal index), including maxima tied within a piece,
across pieces and at a piece's last and next piece's first word; the logprobs equal
``log_softmax`` gathered within 4 ulps of float32 around the value; ``finite`` is False exactly
for rows holding NaN or +inf and rows of -inf only; a row of mostly -inf (a grammar's mask)
keeps its few words; the counters are zero after every launch; and the :class:`Sampler` gives
the same tokens with the kernel and with ``LOOM_GREEDY_KERNEL`` off, with and without
processors, while a step with a sampled row or with alternatives asked for does not take it.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _setup() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import triton_interpret

    triton_interpret.setup_script()


def _reference(x):  # type: ignore[no-untyped-def]
    import torch

    tokens = x.argmax(-1)
    # In float64: torch's float32 log_softmax on the CPU is itself ~50 ulps off on 151,936 words
    logprobs = x.double().log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)
    finite = torch.isfinite(x.amax(-1))
    return tokens, logprobs, finite


def _rows(v: int, gen):  # type: ignore[no-untyped-def]
    import torch

    from loom.sample.greedy_triton import BLOCK

    x = torch.randn(9, v, generator=gen) * 4
    if v > 1:
        x[1, :] = 0.0  # every word ties: the first
        x[2, v // 3] = x[2, v - 1] = 50.0  # a tie across pieces (or within one, for short rows)
        if v > BLOCK:
            x[3, BLOCK - 1] = x[3, BLOCK] = 60.0  # a piece's last word and the next piece's first
            x[4, v - 1] = 70.0  # the last word of the last, ragged piece
    if v > 2:
        x[5] = float("-inf")  # a grammar's mask: three words left
        x[5, 0], x[5, v // 2], x[5, v - 1] = 1.0, 3.0, 2.0
    x[6] = float("-inf")  # nothing to choose: not finite
    x[7, v - 1] = float("nan")  # NaN: not finite
    x[8, 0] = float("inf")  # +inf: not finite
    return x


def check_pick() -> list[str]:
    import torch

    from loom.layers.split_k import last_to_arrive  # noqa: F401  (imported by the kernel module)
    from loom.sample import greedy_triton

    errors: list[str] = []
    gen = torch.Generator().manual_seed(7)
    for v in (1, 2047, 2048, 2049, 49152, 151936):
        x = _rows(v, gen)
        if not greedy_triton.serves(x):
            errors.append(f"V={v}: not served")
            continue
        tok, lp, fin = greedy_triton.greedy_pick(x)
        want_tok, want_lp, want_fin = _reference(x)
        ok_fin = torch.equal(fin, want_fin)
        good = want_fin  # a non-finite row's token and logprob mean nothing (its request fails)
        ok_tok = torch.equal(tok[good], want_tok[good])
        ulp = torch.finfo(torch.float32).eps * want_lp[good].abs().clamp(min=1.0)
        ok_lp = bool(((lp[good].double() - want_lp[good]).abs() <= 4 * ulp).all())
        zero = int(greedy_triton._row_counters(x.device).abs().sum()) == 0
        ok = ok_fin and ok_tok and ok_lp and zero and tok.dtype == torch.int64 and fin.dtype == torch.bool
        print(f"{'ok  ' if ok else 'FAIL'} greedy pick V={v}: {int(good.sum())} finite rows of {x.shape[0]}")
        if not ok:
            errors.append(f"V={v}: finite {ok_fin} tokens {ok_tok} ({tok.tolist()} vs {want_tok.tolist()}) "
                          f"logprobs {ok_lp} ({(lp - want_lp)[good].abs().max().item()}) counters zero {zero}")
    return errors


def check_sampler() -> list[str]:
    import torch

    from loom import kernel_switches
    from loom.sample import greedy_triton
    from loom.sample.batch import SamplingBatch
    from loom.sample.processors import RepetitionPenalty
    from loom.sample.sampler import Sampler

    errors: list[str] = []
    gen = torch.Generator().manual_seed(11)
    n, v = 6, 5000
    logits = torch.randn(n, v, generator=gen) * 3
    logits[2, 17] = logits[2, 4000] = 40.0  # a tie
    calls: list[int] = []
    pick = greedy_triton.greedy_pick

    def counted(x):  # type: ignore[no-untyped-def]
        calls.append(x.shape[0])
        return pick(x)

    greedy_triton.greedy_pick = counted  # type: ignore[assignment]
    seen = torch.rand(n, v, generator=gen) < 0.01
    seen[2, 17] = True  # the tie is broken by the penalty
    penalty = RepetitionPenalty(torch.full((n, 1), 1.3), seen)
    batches = {
        "plain greedy": SamplingBatch(None, None, None, False, 0),
        "greedy after a penalty": SamplingBatch(None, None, None, False, 0, processors=[penalty]),
    }
    sampler = Sampler()
    for name, b in batches.items():
        calls.clear()
        got = sampler(logits, b)
        kernel_switches.greedy_kernel = False
        want = sampler(logits, b)
        kernel_switches.greedy_kernel = True
        ok = (calls == [n] and torch.equal(got.token_ids, want.token_ids) and torch.equal(got.finite, want.finite)
              and torch.allclose(got.logprobs, want.logprobs, rtol=1e-6, atol=1e-6)
              and got.top_ids is None and want.top_ids is None)
        print(f"{'ok  ' if ok else 'FAIL'} sampler, {name}: the kernel's tokens equal the torch path's")
        if not ok:
            errors.append(f"{name}: calls {calls} tokens {got.token_ids.tolist()} vs {want.token_ids.tolist()}")
    # Not taken: a row samples, or alternatives are asked for.
    do_sample = torch.tensor([True] + [False] * (n - 1))
    not_taken = {
        "a sampled row": SamplingBatch(do_sample, torch.arange(n), torch.zeros(n, dtype=torch.int64), True, 0),
        "alternatives": SamplingBatch(None, None, None, False, 3),
    }
    for name, b in not_taken.items():
        calls.clear()
        out = sampler(logits, b)
        ok = calls == [] and (b.max_top_n == 0 or out.top_ids is not None)
        print(f"{'ok  ' if ok else 'FAIL'} sampler, {name}: the general path")
        if not ok:
            errors.append(f"{name}: the kernel ran ({calls})")
    greedy_triton.greedy_pick = pick  # type: ignore[assignment]
    return errors


def main() -> None:
    _setup()
    errors = check_pick() + check_sampler()
    if errors:
        print("\n".join(errors))
        raise SystemExit(1)


if __name__ == "__main__":
    main()
