"""Benchmark workloads (definitions shared with the peers; see docs/benchmarks.md).

A workload is a list of (prompt token ids, new tokens) with greedy decoding and EOS ignored, so
every run generates exactly the tokens asked for.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[tuple[list[int], int]]  # (prompt ids, max_new_tokens)
    description: str

    @property
    def output_tokens(self) -> int:
        return sum(n for _, n in self.requests)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p, _ in self.requests)


def equal_batch(name: str, batch: int, prompt: int, new: int) -> Workload:
    """``batch`` prompts of ``prompt`` ids drawn like the peer (torch seed 0, ids in [100, 40000))."""
    ids = torch.randint(100, 40000, (batch, prompt), generator=torch.Generator().manual_seed(0))
    return Workload(name, [(row, new) for row in ids.tolist()],
                    f"{batch} request(s) x {prompt} prompt tokens, {new} new tokens")


def mixed_c2(n_req: int = 64) -> Workload:
    """C2: per request, prompt length U[16,512], new tokens U[16,256], ids U[100,40000] (Random(3))."""
    rng = random.Random(3)
    reqs = []
    for _ in range(n_req):
        p, n = rng.randint(16, 512), rng.randint(16, 256)
        reqs.append(([rng.randint(100, 40000) for _ in range(p)], n))
    return Workload("C2", reqs, f"{n_req} requests, prompt U[16,512], new U[16,256]")


def serving_w2(n_req: int, new: int = 256, seed: int = 2) -> Workload:
    """W2/W3 lengths: prompt U[128,1024] then ids U[10,1000] request by request (Random(2))."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n_req):
        p = rng.randint(128, 1024)
        reqs.append(([rng.randint(10, 1000) for _ in range(p)], new))
    return Workload("W2", reqs, f"{n_req} requests, prompt U[128,1024], {new} new tokens")


def decode_w1(prompt: int = 512, new: int = 256, seed: int = 1) -> Workload:
    """W1: one request of ``prompt`` ids U[10,1000] (Random(1)), ``new`` tokens."""
    rng = random.Random(seed)
    return Workload("W1", [([rng.randint(10, 1000) for _ in range(prompt)], new)],
                    f"1 request x {prompt} prompt tokens, {new} new tokens")


def w2_requests_for(model_id: str | None) -> int:
    """WORKLOADS.md: 512 requests for llama-1b, 256 for llama-8b (and anything else)."""
    return 512 if model_id is not None and model_id.endswith("llama-1b") else 256


def gpu_workload(name: str, model_id: str | None, quick: bool = False, w2_requests: int | None = None,
                 new_tokens: int | None = None) -> Workload:
    """W1 and W2; ``quick`` shrinks them (32 new tokens; W2 16 requests) to check the harness."""
    if name == "W1":
        return decode_w1(512, new_tokens or (32 if quick else 256))
    if name == "W2":
        count = w2_requests or (16 if quick else w2_requests_for(model_id))
        return serving_w2(count, new_tokens or (32 if quick else 256))
    raise ValueError(f"unknown GPU workload {name!r}; choose W1 or W2")


def serving_w3(n_req: int, new: int) -> Workload:
    """W3: W2's lengths and ids (the first ``n_req`` of them), ``new`` tokens each."""
    w = serving_w2(n_req, new)
    return Workload("W3", w.requests, f"{n_req} requests, prompt U[128,1024], {new} new tokens")


def cpu_workload(name: str, quick: bool = False) -> Workload:
    """C0, C1, C2; ``quick`` shrinks them (for smoke tests of the harness, not for figures)."""
    if name == "C0":
        return equal_batch("C0", 1, 16 if quick else 128, 8 if quick else 128)
    if name == "C1":
        return equal_batch("C1", 4 if quick else 32, 16 if quick else 128, 8 if quick else 128)
    if name == "C2":
        w = mixed_c2(8 if quick else 64)
        if quick:
            w = Workload("C2", [(p[:24], min(n, 8)) for p, n in w.requests], w.description + " (quick)")
        return w
    raise ValueError(f"unknown CPU workload {name!r}; choose C0, C1 or C2")


def shared_prefix_w4(n_req: int = 128, prefix: int = 2048, unique: int = 64, new: int = 64,
                     seed: int = 4) -> Workload:
    """W4: ``n_req`` requests sharing one ``prefix``-token prompt prefix, each with ``unique`` ids
    of its own after it (all ids U[10,1000], Random(seed)), ``new`` tokens each."""
    rng = random.Random(seed)
    shared = [rng.randint(10, 1000) for _ in range(prefix)]
    reqs = [(shared + [rng.randint(10, 1000) for _ in range(unique)], new) for _ in range(n_req)]
    return Workload("W4", reqs, f"{n_req} requests sharing a {prefix}-token prefix + {unique} unique, {new} new")
