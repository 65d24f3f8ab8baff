"""The Hugging Face transformers peer: ``generate()`` the way a user without Loom runs it.

On the CPU (C0-C2): ``generate()`` on the model Loom served. On the GPU (W1, W2): the measurements
of ../shared/bench/hf_peer.py, re-implemented here so they run in the same process and on the same
model shape right after Loom's engine process has exited.
"""

from __future__ import annotations

import gc
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from .workloads import Workload


def load_peer(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _generate(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, new: int) -> None:
    model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,  # type: ignore[operator]
                   do_sample=False, pad_token_id=0)


@torch.inference_mode()
def run_peer(model: torch.nn.Module, w: Workload, per_batch: int | None = None) -> dict[str, float]:
    """Equal-length workloads run as one batch; mixed ones in left-padded batches of ``per_batch``
    in arrival order, each batch generating its longest request's count. Only the tokens the
    requests asked for count."""
    warm = torch.tensor([w.requests[0][0][:8]])
    _generate(model, warm, torch.ones_like(warm), 2)
    batch = per_batch or len(w.requests)
    start = time.perf_counter()
    for i in range(0, len(w.requests), batch):
        chunk = w.requests[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        _generate(model, ids, mask, max(n for _, n in chunk))
    dt = time.perf_counter() - start
    return {"s": dt, "out_tokens": w.output_tokens, "out_tok_s": w.output_tokens / dt}


# -- the GPU peer: ../shared/bench/hf_peer.py's measurements, on the model Loom just ran --------------------


def build_hf_model(model_dir: Path, dtype: torch.dtype, device: torch.device, attn: str = "sdpa",
                   seed: int = 0) -> torch.nn.Module:
    """transformers' model of ``model_dir`` in ``dtype`` on ``device``.

    A random-weight model (``random:NAME``) is built from its config with transformers' own
    random init under ``torch.manual_seed(seed)`` directly on the device, as the peer script
    does; a real checkpoint is loaded.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from loom.model_loader import default_dtype
    from loom.model_loader.random_model import random_weights_of

    config = AutoConfig.from_pretrained(str(model_dir))
    if random_weights_of(config) is None:
        loaded: torch.nn.Module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                                       attn_implementation=attn)
        return loaded.to(device).eval()
    torch.manual_seed(seed)
    with torch.device(device), default_dtype(dtype):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    return model.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def static_generate(model: torch.nn.Module, device: torch.device, batch: int, prompt: int,
                    new: int) -> dict[str, float]:
    """generate() on ``batch`` prompts of ``prompt`` ids U[10,1000) (device generator seed 1),
    exactly ``new`` tokens each; a 4-token generate() first warms it up. (generate() runs under
    no_grad itself; like the peer script, no inference_mode around it.)"""
    from transformers import GenerationConfig

    gen = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(10, 1000, (batch, prompt), device=device, generator=gen)
    config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    warm = GenerationConfig(max_new_tokens=4, do_sample=False, pad_token_id=0)
    model.generate(ids[:, :16], generation_config=warm)  # type: ignore[operator]
    _sync(device)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)  # type: ignore[operator]
    _sync(device)
    dt = time.perf_counter() - start
    tokens = batch * (out.shape[1] - prompt)
    return {"batch": batch, "prompt": prompt, "new": new, "s": dt, "out_tokens": tokens, "out_tok_s": tokens / dt}


def continuous_batching(model: torch.nn.Module, device: torch.device, w: Workload) -> dict[str, Any]:
    """generate_batch() (transformers' continuous batching, paged sdpa) on every request of ``w``.

    Versions of transformers without generate_batch() report the error instead of a figure, and
    so does a run in which requests failed (generate_batch() logs those rather than raising).
    Not under inference_mode: generate_batch() updates its own tensors in place outside it.
    """
    from transformers import GenerationConfig

    new = max(n for _, n in w.requests)
    inputs = [list(p) for p, _ in w.requests]
    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    try:
        model.set_attn_implementation("paged|sdpa")  # type: ignore[operator]
        start = time.perf_counter()
        results = model.generate_batch(inputs=inputs, generation_config=config,  # type: ignore[operator]
                                       progress_bar=False)
        _sync(device)
        dt = time.perf_counter() - start
    except Exception:
        return {"name": "hf-generate_batch", "error": traceback.format_exc()[-800:]}
    out_tokens = sum(len(r.generated_tokens) for r in results.values())
    if out_tokens < w.output_tokens:
        return {"name": "hf-generate_batch", "error": f"generate_batch() returned {len(results)} of "
                f"{len(inputs)} requests and {out_tokens} of {w.output_tokens} tokens (see its log above)"}
    return {"name": "hf-generate_batch", "attn": "paged|sdpa", "requests": len(inputs), "done": len(results),
            "s": dt, "out_tokens": out_tokens, "out_tok_s": out_tokens / dt,
            "total_tok_s": (out_tokens + w.prompt_tokens) / dt}


def run_gpu_peer(model_dir: Path, dtype: torch.dtype, device: torch.device, workloads: list[Workload],
                 static_batches: list[int], static_new: int, w2_timeout_s: float | None = None) -> dict[str, Any]:
    """The peer on W1 (generate() at batch 1), static batches, and W2 (generate_batch()), in that
    order (generate_batch() switches the attention implementation, so it runs last).

    With ``w2_timeout_s``, W2 runs in a child process of its own (:func:`bounded_continuous_batching`)
    and is stopped after that long: a peer too slow to finish still yields an upper bound on its
    throughput (W2's tokens / the time it was given), so Loom's ratio to it has a lower bound.
    """
    import transformers

    w2 = next((w for w in workloads if w.name == "W2"), None)
    out: dict[str, Any] = {"transformers": transformers.__version__, "static": []}
    in_process = [w for w in workloads if w.name == "W1"] or static_batches or (w2 is not None and w2_timeout_s is None)
    if in_process:
        _run_peer_in_process(model_dir, dtype, device, workloads, static_batches, static_new,
                             w2 if w2_timeout_s is None else None, out)
    if w2 is not None and w2_timeout_s is not None:
        out["W2"] = bounded_continuous_batching(model_dir, dtype, device, w2, w2_timeout_s)
    return out


def _run_peer_in_process(model_dir: Path, dtype: torch.dtype, device: torch.device, workloads: list[Workload],
                         static_batches: list[int], static_new: int, w2: Workload | None,
                         out: dict[str, Any]) -> None:
    model = build_hf_model(model_dir, dtype, device)
    try:
        for w in workloads:
            if w.name == "W1":
                (prompt, new), = w.requests
                out["W1"] = {"name": "hf-generate", **_guarded(static_generate, model, device, 1, len(prompt), new)}
        for batch in static_batches:
            out["static"].append(_guarded(static_generate, model, device, batch, 512, static_new))
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if w2 is not None:
            out["W2"] = continuous_batching(model, device, w2)
    finally:
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _w2_child(model_dir: str, dtype: torch.dtype, device: str, w: Workload, conn: Any) -> None:
    """The child of :func:`bounded_continuous_batching`: builds the peer, says when W2 starts, runs it."""
    try:
        dev = torch.device(device)
        model = build_hf_model(Path(model_dir), dtype, dev)
        conn.send(("start", time.time()))
        conn.send(("done", continuous_batching(model, dev, w)))
    except Exception:
        conn.send(("done", {"name": "hf-generate_batch", "error": traceback.format_exc()[-800:]}))
    finally:
        conn.close()


def bounded_continuous_batching(model_dir: Path, dtype: torch.dtype, device: torch.device, w: Workload,
                                timeout_s: float) -> dict[str, Any]:
    """:func:`continuous_batching` in a spawned child process, given ``timeout_s`` from the moment W2
    starts (building the model is not counted). A run that has not finished by then is killed and
    reported as ``{"timed_out": true, "s_at_least": timeout_s, "out_tok_s_at_most": tokens / timeout_s}``:
    whatever it would have reached, its W2 throughput is below that bound."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_w2_child, args=(str(model_dir), dtype, str(device), w, child), daemon=True)
    proc.start()
    child.close()
    try:
        kind, value = parent.recv()  # the model build takes as long as it takes
        if kind == "done":  # failed before W2 started
            return dict(value)
        if parent.poll(timeout_s):
            return dict(parent.recv()[1])
        return {"name": "hf-generate_batch", "attn": "paged|sdpa", "requests": len(w.requests),
                "timed_out": True, "s_at_least": timeout_s, "out_tokens": w.output_tokens,
                "out_tok_s_at_most": w.output_tokens / timeout_s}
    except EOFError:
        return {"name": "hf-generate_batch", "error": f"the peer's process died (exit code {proc.exitcode})"}
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(30)
        parent.close()


def _guarded(fn: Any, *args: Any) -> dict[str, Any]:
    try:
        result: dict[str, Any] = fn(*args)
        return result
    except Exception as exc:  # out of memory at a large batch, say: report it, keep going
        return {"error": repr(exc)[:300]}
