"""A latency target for steps that carry decodes (``--max-step-latency-ms``): how many prompt tokens
such a step may prefill.

Every running stream waits for each step, so a step that prefills 16,384 prompt tokens stalls all
of them (TGI users' complaint about inter-token latency under load). With a target, a step that
has decode rows gets a prefill budget from a model of step time fitted to the engine's own recent
steps,

    step_s ~= a + m * [prefill_tokens > 0] + b * decode_rows + c * prefill_tokens

by least squares over the last ``window`` steps of one busy period. ``m`` is what a step pays for
carrying any prompt tokens at all: on a GPU a decode-only step replays a CUDA graph while a mixed
step runs eagerly (kernel launches from the host), and one intercept for both under-predicted the
mixed steps, which the budget is about (on the H200, 2026-12-02, steps with a 50 ms target ran
70 ms). The budget is the prefill
tokens that keep the predicted step within the target (at least ``min_tokens``, so prompts always
advance; at most ``--max-batch-prefill-tokens``). A step without decodes keeps the whole
``--max-batch-prefill-tokens``: nobody is waiting on it for a token.

A step's time is the gap between its launch and the next one: with asynchronous scheduling that
is what a stream sees between tokens (the larger of host and device time). Gaps across an idle
period are not steps and are never observed.
"""

from __future__ import annotations

from collections import deque

import numpy as np

# Until this many steps with different prefill sizes are observed, steps with decodes prefill at
# most _COLD_TOKENS: a guess that keeps the first steps short on any hardware.
_MIN_OBSERVATIONS = 8
_COLD_TOKENS = 256


class StepLatencyModel:
    def __init__(self, target_s: float, max_tokens: int, min_tokens: int = 16, window: int = 256) -> None:
        if target_s <= 0:
            raise ValueError(f"the step latency target must be positive, got {target_s}")
        self.target_s = target_s
        self.max_tokens = max_tokens
        self.min_tokens = min(min_tokens, max_tokens)
        self._obs: deque[tuple[int, int, float]] = deque(maxlen=window)  # (decode rows, prefill tokens, s)
        self._coef: tuple[float, float, float, float] | None = None  # (a, m, b, c), refitted lazily
        self._dirty = False

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        self._obs.append((decode_rows, prefill_tokens, seconds))
        self._dirty = True

    @property
    def coefficients(self) -> tuple[float, float, float, float] | None:
        """(a seconds, m seconds for a step with prompt tokens, b seconds per decode row, c seconds
        per prefill token), or None before the model has seen enough different steps."""
        if self._dirty:
            self._dirty = False
            self._coef = self._fit()
        return self._coef

    def _fit(self) -> tuple[float, float, float, float] | None:
        if len(self._obs) < _MIN_OBSERVATIONS or len({p for _, p, _ in self._obs}) < 3:
            return self._coef  # keep the last fit (None at first)
        data = np.asarray(self._obs, dtype=np.float64)  # [n, 3]
        mixed = (data[:, 1] > 0).astype(np.float64)
        # Without decode-only steps in the window the mixed column equals the constant one: the
        # least-norm solution splits a and m, and a + m (what the budget uses) is still the fit.
        x = np.column_stack([np.ones(len(data)), mixed, data[:, 0], data[:, 1]])
        coef, *_ = np.linalg.lstsq(x, data[:, 2], rcond=None)
        a, m, b, c = (float(v) for v in coef)
        if not c > 0:  # prefill tokens that cost nothing: noise; keep the last fit
            return self._coef
        a = max(a, 0.0)
        return a, max(m, -a), max(b, 0.0), c

    def prefill_budget(self, decode_rows: int) -> int:
        """Prompt tokens a step with ``decode_rows`` decodes may prefill to meet the target."""
        coef = self.coefficients
        if coef is None:
            return max(self.min_tokens, min(self.max_tokens, _COLD_TOKENS))
        a, m, b, c = coef
        room = self.target_s - a - m - b * decode_rows
        tokens = int(room / c) if room > 0 else 0
        return max(self.min_tokens, min(self.max_tokens, tokens))
