"""The attention backend contract: one ``prepare`` per step whose plan reaches every layer's
``forward``, metadata that takes no attributes, and the contract importable from ``loom.plugin_api``."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers.paged_cases import make_step

from loom.engine.types import EngineRequest, SamplingParams, StoppingParams
from loom.layers.attention import AttentionBackend, AttentionMetadata
from loom_plugins.attention.torch_backend import TorchAttentionBackend


def test_prepare_runs_once_per_step_and_its_plan_reaches_every_layer(
        make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(max_batch_total_tokens=256)
    backend, runner = engine.worker.backend, engine.runner
    num_layers = len(runner.kv_caches)
    events: list[tuple[str, Any]] = []
    prepare, forward, launch = backend.prepare, backend.forward, runner.launch

    def counting_prepare(meta: AttentionMetadata) -> Any:
        plan = prepare(meta)
        events.append(("prepare", (meta, plan)))
        return plan

    def counting_forward(q: Any, k: Any, v: Any, cache: Any, meta: AttentionMetadata, plan: Any,
                         *rest: Any) -> Any:
        events.append(("forward", (meta, plan)))
        return forward(q, k, v, cache, meta, plan, *rest)

    def counting_launch(sched: Any) -> Any:
        events.append(("step", None))
        return launch(sched)

    monkeypatch.setattr(backend, "prepare", counting_prepare)
    monkeypatch.setattr(backend, "forward", counting_forward)
    monkeypatch.setattr(runner, "launch", counting_launch)
    for i, n in enumerate((5, 30, 12)):  # prompts of different lengths: prefill, mixed and decode steps
        engine.add_request(EngineRequest(f"r{i}", tuple(range(3, 3 + n)), SamplingParams(),
                                         StoppingParams(max_new_tokens=4, ignore_eos=True)))
    while engine.has_unfinished():
        engine.step()

    steps = [i for i, (kind, _) in enumerate(events) if kind == "step"]
    assert len(steps) >= 4
    for lo, hi in zip(steps, [*steps[1:], len(events)], strict=True):
        step = events[lo + 1 : hi]
        # One prepare, then one forward per layer with that very metadata and plan.
        assert [kind for kind, _ in step] == ["prepare"] + ["forward"] * num_layers
        meta, plan = step[0][1]
        assert all(m is meta and p is plan for _, (m, p) in step[1:])
    plans = [payload[1] for kind, payload in events if kind == "prepare"]
    assert any(p.prefills for p in plans) and any(not p.prefills for p in plans)  # prefill and decode steps


def _meta() -> AttentionMetadata:
    return make_step([(5, 1), (0, 4)], num_heads=4, num_kv_heads=2, head_dim=16).meta


def test_metadata_takes_no_attributes() -> None:
    meta = _meta()
    assert not hasattr(meta, "__dict__")
    with pytest.raises(AttributeError):
        meta._plan = object()  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        setattr(meta, "_paged_triton_plan", object())  # what the backends used to do  # noqa: B010


def test_backends_keep_their_plan_off_the_metadata() -> None:
    """prepare() and forward() of the torch backend leave the metadata's fields untouched (a new
    attribute would raise on the slotted metadata), and the plan is a fresh object per call."""
    step = make_step([(20, 1), (0, 6), (3, 1)], num_heads=4, num_kv_heads=2, head_dim=16)
    before = {f.name: getattr(step.meta, f.name) for f in dataclasses.fields(step.meta)}
    backend = TorchAttentionBackend(4, 2, 16, torch.float32, torch.device("cpu"))
    plan = backend.prepare(step.meta)
    assert backend.prepare(step.meta) is not plan
    backend.forward(step.q, step.k, step.v, step.kv_cache, step.meta, plan, 0.25, None)
    assert all(getattr(step.meta, name) is value for name, value in before.items())


def test_base_backend_states_its_capabilities() -> None:
    base = AttentionBackend(4, 2, 16, torch.float32, torch.device("cpu"))
    with pytest.raises(NotImplementedError, match="prepare"):
        base.prepare(_meta())
    assert not base.can_capture(1) and not base.can_capture(3)
    with pytest.raises(ValueError, match="cannot capture"):
        base.init_cuda_graph_state(4, 8, 16, 1)
    torch_backend = TorchAttentionBackend(4, 2, 16, torch.float32, torch.device("cpu"))
    assert not torch_backend.can_capture(1)
    assert not base.supports_logits_soft_cap and torch_backend.supports_logits_soft_cap


def test_a_capped_layer_refuses_a_backend_without_the_cap_and_others_never_pass_it() -> None:
    """Gemma 2's soft cap reaches backends that declare it; a backend written before it (no
    ``logits_soft_cap`` parameter) still serves every layer that does not cap."""
    from loom.layers.attention import Attention, ForwardContext, forward_context

    class OldBackend(TorchAttentionBackend):
        name = "old"
        supports_logits_soft_cap = False

        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,  # type: ignore[override]
                    meta: AttentionMetadata, plan: Any, scale: float, sliding_window: int | None) -> torch.Tensor:
            return super().forward(q, k, v, kv_cache, meta, plan, scale, sliding_window)

    step = make_step([(3, 1), (0, 4)], num_heads=4, num_kv_heads=2, head_dim=16)
    q, k, v = (t.reshape(t.shape[0], -1) for t in (step.q, step.k, step.v))
    for backend_cls in (OldBackend, TorchAttentionBackend):
        backend = backend_cls(4, 2, 16, torch.float32, torch.device("cpu"))
        ctx = ForwardContext(backend, [step.kv_cache.clone()], step.meta, backend.prepare(step.meta))
        with forward_context(ctx):
            plain = Attention(0, 4, 2, 16)(q, k, v)
            assert plain.shape == q.shape
            capped = Attention(0, 4, 2, 16, logits_soft_cap=1.0)
            if backend_cls is OldBackend:
                with pytest.raises(ValueError, match="'old' attention backend does not implement"):
                    capped(q, k, v)
            else:
                assert not torch.allclose(capped(q, k, v), plain)
    with pytest.raises(ValueError, match="logits_soft_cap must be positive"):
        Attention(0, 4, 2, 16, logits_soft_cap=0.0)


def test_plugin_api_exports_the_contract_without_importing_torch_first() -> None:
    import loom.layers.attention as attention
    import loom.plugin_api as api

    assert api.AttentionBackend is attention.AttentionBackend
    assert api.AttentionMetadata is attention.AttentionMetadata
    assert api.write_kv is attention.write_kv
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        api.Nope  # type: ignore[attr-defined]  # noqa: B018
    code = "import sys, loom.plugin_api; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
