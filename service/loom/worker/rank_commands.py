"""What the engine sends every tensor-parallel rank, once, by broadcast (typed, picklable).

Each command carries a sequence number; a rank writes it to the shared step counters
(``loom.distributed.progress``) once it has carried the command out.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.sample.batch import TokenBitmaskRows

from .step_plan import StepPlan


@dataclass(frozen=True, slots=True)
class InitKvCache:
    num_blocks: int


@dataclass(frozen=True, slots=True)
class FreeKvCache:
    pass


@dataclass(frozen=True, slots=True)
class Execute:
    """Run one step plan (every rank samples the same tokens: same logits, same counter-based noise)."""

    plan: StepPlan


@dataclass(frozen=True, slots=True)
class ExecuteForward:
    """Run one step plan's forward; its sampling follows as :class:`Sample` (structured output
    fills the grammar rows in between, on rank 0, while the ranks run the forward)."""

    plan: StepPlan


@dataclass(frozen=True, slots=True)
class Sample:
    """Sample the step of the last :class:`ExecuteForward` with these grammar rows (the same on every rank)."""

    bitmask: TokenBitmaskRows | None


@dataclass(frozen=True, slots=True)
class CaptureGraphs:
    max_model_len: int
    query_lens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ProfileStart:
    """GPU pool sizing: reset the memory peak; a warm-up (Execute commands) follows."""


@dataclass(frozen=True, slots=True)
class ProfileEnd:
    """Measure the warm-up's peak and answer (activations, weights and state, total) by gather."""


@dataclass(frozen=True, slots=True)
class Stop:
    pass


RankCommand = InitKvCache | FreeKvCache | Execute | ExecuteForward | Sample | CaptureGraphs | ProfileStart | ProfileEnd | Stop


@dataclass(frozen=True, slots=True)
class Envelope:
    seq: int
    command: RankCommand
