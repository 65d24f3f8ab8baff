"""The host path of a step, trimmed for batch-1 speculation (W5 a): a step's integer arrays go to
the device in one transfer per dtype, each view aligned as single transfers were; a greedy step
without penalties stages no per-row sampling columns; the tokens are those of the full path."""

from __future__ import annotations

import torch

from loom.sample.batch import SAMPLE, SamplingPlan, build_sampling_batch
from loom.sample.sampler import Sampler
from loom.worker.staging import Stager


def test_arrays_staged_together_come_back_whole_and_aligned() -> None:
    stage = Stager(torch.device("cpu"))
    arrays = [[5, -1, 7], [], list(range(130)), [2**40]]
    views = stage.to_device_many(arrays, torch.int64)
    assert [v.tolist() for v in views] == arrays
    assert all(v.dtype == torch.int64 for v in views)
    base = views[0].data_ptr()
    # each starts on a 64-element boundary of the one buffer (Triton specialises on pointer alignment)
    assert all((v.data_ptr() - base) % (64 * 8) == 0 for v in views if v.numel())
    tables, = stage.to_device_many([[1, 2, 3, 4, 5, 6]], torch.int32)
    assert tables.view(2, 3).tolist() == [[1, 2, 3], [4, 5, 6]] and tables.dtype == torch.int32
    assert [v.numel() for v in stage.to_device_many([[], []], torch.int32)] == [0, 0]


def test_a_greedy_step_stages_no_sampling_columns_and_chooses_the_same_tokens() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    greedy = SamplingPlan.greedy(4, 50)
    lean = build_sampling_batch(greedy, 50, torch.device("cpu"))
    assert lean.do_sample is None and lean.seeds is None and lean.steps is None and not lean.any_sample
    # the same rows as a plan that stages its columns (a sampling row elsewhere in the batch, off here)
    full = build_sampling_batch(SamplingPlan(floats=greedy.floats, ints=greedy.ints, flags=SAMPLE, banned=[],
                                             top_n=greedy.top_n), 50, torch.device("cpu"))
    assert full.do_sample is not None and not bool(full.do_sample.any())
    a, b = Sampler()(logits, lean), Sampler()(logits, full)
    assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.logprobs, b.logprobs)
    assert torch.equal(a.token_ids, logits.argmax(-1))


def test_registered_grammar_rows_are_used_in_place_and_lose_the_mark_when_pickled() -> None:
    """Rows in page-locked shared memory (the grammar process's, on CUDA) go to the device without
    a host copy; on the CPU the processor reads the host tensor itself. A tensor-parallel rank gets
    the rows as bytes, which are not registered memory."""
    import pickle

    from loom.sample.batch import TokenBitmaskRows, token_bitmask
    from loom.worker.staging import HostRegistration

    data = torch.arange(3 * 4, dtype=torch.int32).view(3, 4)
    rows = TokenBitmaskRows([0, 2, 5], 4, data, registered=True)
    stage = Stager(torch.device("cpu"))
    assert stage.from_registered(data) is data
    assert token_bitmask(rows, stage).bitmask.data_ptr() == data.data_ptr()
    again = pickle.loads(pickle.dumps(rows))
    assert again == rows and again.registered is False
    if not torch.cuda.is_available():
        assert HostRegistration.of(data) is None  # copies stay staged, as from pageable memory
