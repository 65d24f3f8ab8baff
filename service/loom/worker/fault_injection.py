"""Test-only fault injection (``--fault-injection``): a model runner that fails chosen requests
on purpose, so that tests can check failure isolation. The engine installs it in place of
:class:`~loom.worker.model_runner.ModelRunner` only when ``EngineConfig.fault_injection`` is set;
the ordinary runner has no fault-injection branch.

- A step holding a request whose id starts with ``inject-fault`` raises :class:`InjectedFault`
  before its forward (the whole step fails, as a kernel error would).
- A row of a request whose id starts with ``inject-nan`` gets NaN logits (only its request fails,
  on the sampler's finite check).
"""

from __future__ import annotations

import torch

from .model_runner import ModelRunner, StepInputs


class InjectedFault(RuntimeError):
    """Raised on purpose (``--fault-injection``) to test failure isolation."""


class FaultInjectingRunner(ModelRunner):
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        for request_id in inputs.plan.sample_request_ids if inputs.plan is not None else ():
            if request_id.startswith("inject-fault"):
                raise InjectedFault(f"injected failure while running request {request_id!r}")
        return super().forward(inputs)

    def sample_logits(self, hidden: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        logits = super().sample_logits(hidden, inputs)  # [N, V]
        for i, request_id in enumerate(inputs.plan.sample_request_ids if inputs.plan is not None else ()):
            if request_id.startswith("inject-nan"):
                logits[i] = float("nan")
        return logits
