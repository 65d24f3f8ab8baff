"""The step's sampling tensors, built from the plan's sampling rows (one per sequence that chooses
a token), and the processors some row of the step needs (see :mod:`loom.sample.processors`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loom.worker.staging import Stager

from .processors import (
    FrequencyPresencePenalty,
    LogitsProcessor,
    MinP,
    RepetitionPenalty,
    Suppression,
    Temperature,
    TokenBitmask,
    TopK,
    TopP,
    TypicalP,
)


@dataclass
class SamplingBatch:
    """One step's sampling inputs on the logits' device. N rows."""

    # [N] bool, [N] int64 seeds, [N] int64 output positions being sampled; None when no row
    # samples (greedy rows read none of them)
    do_sample: torch.Tensor | None
    seeds: torch.Tensor | None
    steps: torch.Tensor | None
    any_sample: bool
    max_top_n: int
    # Shape the reported distribution (penalties, suppression, temperature), in order.
    processors: list[LogitsProcessor] = field(default_factory=list)
    # Narrow what sampled rows draw from (top_k, top_p, typical_p, min_p), in order.
    filters: list[LogitsProcessor] = field(default_factory=list)


# Bits of SamplingPlan.flags: the processors some row enables.
SAMPLE, TOP_K, TOP_P, TYPICAL, MIN_P, REPETITION, FREQUENCY = (1 << i for i in range(7))


@dataclass(slots=True, eq=False)
class TokenBitmaskRows:
    """Structured output's masks for a step, as plain data: the bitmask rows of the sampling rows
    in ``rows`` (ascending), ``words`` int32 words each (bit j of word w: token 32w + j allowed);
    the worker makes them a :class:`TokenBitmask`.

    ``data`` is the [G, words] int32 rows: in the engine's process the driver's host tensor
    itself (no copy: 64 rows are 393 KB, and two copies of them cost ~40 us a step on the
    project's VM; the driver does not write it again before its next step but one), and native
    order bytes once pickled (a tensor-parallel rank's command), which is also what equality
    compares."""

    rows: list[int]  # [G] sampling rows that have a grammar
    words: int  # ceil(V / 32)
    data: bytes | torch.Tensor  # [G, words] int32
    # ``data`` lies in page-locked host memory (the grammar process's shared rows, registered with
    # the GPU): it is copied to the device straight from there, not through the stager's buffers
    registered: bool = False
    # (a [1] int32 host word, a value): ``data`` is complete only once the word reaches the value;
    # the copy waits for it on the device's stream (a CPU stager checks it was reached). None: complete
    ready: tuple[torch.Tensor, int] | None = None

    def tensor(self) -> torch.Tensor:
        """The rows as a [G, words] int32 host tensor."""
        if isinstance(self.data, torch.Tensor):
            return self.data
        return torch.frombuffer(bytearray(self.data), dtype=torch.int32).view(len(self.rows), self.words)

    def to_bytes(self) -> bytes:
        return self.data.numpy().tobytes() if isinstance(self.data, torch.Tensor) else self.data

    def __getstate__(self) -> tuple[list[int], int, bytes]:
        return self.rows, self.words, self.to_bytes()

    def __setstate__(self, state: tuple[list[int], int, bytes]) -> None:
        self.rows, self.words, self.data = state
        self.registered = False
        self.ready = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TokenBitmaskRows):
            return NotImplemented
        return self.rows == other.rows and self.words == other.words and self.to_bytes() == other.to_bytes()


@dataclass(slots=True)
class SamplingPlan:
    """One step's sampling parameters as plain numbers, built by the engine core from its
    sequences (``loom.engine.step_planner``) and turned into tensors by the worker. N rows."""

    # [N] (temperature, top_p, typical_p, min_p, do_sample, repetition, frequency and presence
    # penalties); greedy rows carry neutral warpers so their logprobs are the penalised ones
    floats: list[tuple[float, ...]]
    ints: list[tuple[int, int, int]]  # [N] (top_k, seed as int64, output position being sampled)
    flags: int  # the union of the rows' processor bits (SAMPLE, TOP_K, ...)
    banned: list[int]  # flat indices row * V + token: EOS / stop ids of rows before min_new_tokens
    top_n: list[int]  # [N] alternatives to report per row
    seen_token_ids: list[list[int]] | None = None  # [N] every token so far (repetition penalty)
    output_token_ids: list[list[int]] | None = None  # [N] output tokens (frequency / presence)
    bitmask: TokenBitmaskRows | None = None  # grammar rows (structured output); None: no row has one

    @property
    def num_rows(self) -> int:
        return len(self.floats)

    @classmethod
    def greedy(cls, rows: int, vocab_size: int) -> SamplingPlan:
        """``rows`` greedy rows with neutral parameters (a draft model's steps, benchmarks)."""
        return cls(floats=[(1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0)] * rows, ints=[(vocab_size, 0, 0)] * rows,
                   flags=0, banned=[], top_n=[0] * rows)


def build_sampling_batch(plan: SamplingPlan, vocab_size: int, device: torch.device,
                         stager: Stager | None = None) -> SamplingBatch:
    """Per-row parameters on ``device`` and the processors some row enables. With a ``stager``
    the small per-row arrays go through pinned buffers without making the host wait (see
    :mod:`loom.worker.staging`)."""
    stage = stager or Stager(device)
    flags = plan.flags
    # One transfer per dtype: float columns [N, 8], int64 columns [N, 3] (top_k, seed, step),
    # each only when some row reads it: sampling (temperature, the filters, the noise's seeds and
    # steps) or a penalty. A greedy step without penalties (W5 a; a draft model's steps) stages
    # nothing here: two host-to-device copies and a comparison fewer in its host path.
    n = plan.num_rows  # 0 in a step of prefill chunks that complete no prompt
    sampled = bool(flags & SAMPLE)
    floats = stage.to_device(plan.floats, torch.float32).view(n, 8) \
        if flags & (SAMPLE | REPETITION | FREQUENCY) else None
    ints = stage.to_device(plan.ints, torch.int64).view(n, 3) if sampled else None
    processors: list[LogitsProcessor] = []
    if plan.bitmask is not None:  # first: the penalties and temperature see the constrained rows
        processors.append(token_bitmask(plan.bitmask, stage, n))
    if plan.banned:
        processors.append(Suppression(stage.to_device(plan.banned, torch.int64)))
    if flags & REPETITION:
        assert plan.seen_token_ids is not None and floats is not None
        seen = torch.zeros(n, vocab_size + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, _padded(plan.seen_token_ids, vocab_size, device), True)
        processors.append(RepetitionPenalty(floats[:, 5:6], seen[:, :vocab_size]))
    if flags & FREQUENCY:
        assert plan.output_token_ids is not None and floats is not None
        counts = torch.zeros(n, vocab_size + 1, dtype=torch.float32, device=device)
        ids = _padded(plan.output_token_ids, vocab_size, device)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
        processors.append(FrequencyPresencePenalty(floats[:, 6:7], floats[:, 7:8], counts[:, :vocab_size]))
    filters: list[LogitsProcessor] = []
    if sampled:
        assert floats is not None and ints is not None
        processors.append(Temperature(floats[:, 0:1]))
        if flags & TOP_K:
            filters.append(TopK(ints[:, 0:1]))
        if flags & TOP_P:
            filters.append(TopP(floats[:, 1:2]))
        if flags & TYPICAL:
            filters.append(TypicalP(floats[:, 2:3]))
        if flags & MIN_P:
            filters.append(MinP(floats[:, 3:4]))
    return SamplingBatch(
        do_sample=floats[:, 4] > 0.5 if sampled and floats is not None else None,
        seeds=ints[:, 1] if ints is not None else None,
        steps=ints[:, 2] if ints is not None else None,
        any_sample=sampled,
        max_top_n=max(plan.top_n, default=0),
        processors=processors,
        filters=filters,
    )


def token_bitmask(masks: TokenBitmaskRows, stage: Stager, num_rows: int | None = None) -> TokenBitmask:
    """The grammar rows as a processor on the stager's device (the first of a step's processors).
    With ``num_rows`` (the step's sampling rows) and a grammar on every row, the row indices are
    not staged: the processor masks all rows in order without reading them."""
    every = num_rows is not None and len(masks.rows) == num_rows  # rows ascending and distinct: 0..N-1
    rows = None if every else stage.to_device(masks.rows, torch.int64)
    if masks.ready is not None:
        stage.after_host_word(*masks.ready)
    host = masks.tensor()
    bitmask = stage.from_registered(host) if masks.registered else stage.to_device(host, torch.int32)
    return TokenBitmask(bitmask, rows, masks.rows)


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0) or 1
    out = torch.full((len(rows), width), pad, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    return out.to(device)
