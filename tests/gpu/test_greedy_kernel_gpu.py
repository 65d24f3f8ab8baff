"""The one-launch greedy pick (``loom.sample.greedy_triton``) on a GPU: the tokens of
``torch.argmax`` (ties to the first index), logprobs within 1e-5 of ``log_softmax`` in float64
(Triton's ``exp`` and ``log`` on the GPU are approximate to ~2 ulps), non-finite rows flagged, the
counters zero after every launch; and the sampler's tokens equal with the kernel and with
``LOOM_GREEDY_KERNEL`` off, at the vocabularies of SmolLM2, Llama 3, Qwen3 and Gemma 3 and 1 to 256 rows."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from loom import kernel_switches
from loom.sample import greedy_triton
from loom.sample.batch import SamplingBatch
from loom.sample.sampler import Sampler

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("vocab", [49152, 128256, 151936, 262208])
@pytest.mark.parametrize("rows", [1, 7, 256])
def test_the_greedy_kernel_picks_argmax_and_its_logprob(vocab: int, rows: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows * vocab)
    x = torch.randn(rows, vocab, device="cuda", generator=gen) * 4
    x[0, vocab // 5] = x[0, vocab - 1] = 60.0  # a tie across pieces: the first
    if rows > 3:
        x[1] = float("-inf")
        x[2, 3] = float("nan")
        x[3, vocab // 2] = float("inf")
    assert greedy_triton.serves(x)
    tok, lp, fin = greedy_triton.greedy_pick(x)
    want_fin = torch.isfinite(x.amax(-1))
    assert torch.equal(fin, want_fin)
    good = want_fin
    want_tok = x.argmax(-1)
    assert torch.equal(tok[good], want_tok[good])
    want_lp = x.double().log_softmax(-1).gather(1, want_tok[:, None]).squeeze(1)
    assert (lp[good].double() - want_lp[good]).abs().max().item() <= 1e-5
    assert int(greedy_triton._row_counters(x.device).abs().sum()) == 0
    out_on = Sampler()(x, SamplingBatch(None, None, None, False, 0))
    kernel_switches.greedy_kernel = False
    try:
        out_off = Sampler()(x, SamplingBatch(None, None, None, False, 0))
    finally:
        kernel_switches.greedy_kernel = True
    assert torch.equal(out_on.token_ids[good], out_off.token_ids[good])
    assert torch.equal(out_on.finite, out_off.finite)
    assert torch.allclose(out_on.logprobs[good], out_off.logprobs[good], rtol=1e-5, atol=1e-5)
