"""`loom bench` and random-weight models: the harness on CPU with tiny shapes.

The figures themselves are not checked (the machine is shared); the shapes of the results, the
physical-limit arithmetic and the random models' determinism are.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from loom.bench.limits import Hardware, ModelCost, w1_limit, w2_limit
from loom.bench.serving import RequestTiming, arrival_offsets, serve_args, summarize
from loom.bench.workloads import Workload, cpu_workload, decode_w1, gpu_workload, serving_w2, serving_w3
from loom.config import EngineConfig
from loom.model_loader import ModelLoadError, load_hf_config, load_model, resolve_model_dir
from loom.model_loader.random_model import RandomWeights, init_random_weights, random_weights_of
from loom.plugin_api import PluginRegistry

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def random_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Random-weight model directories go to a temporary cache."""
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path))
    return tmp_path


def bench_env(cache: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOM_") or k == "LOOM_CACHE_DIR"}
    paths = [str(ROOT / "service"), str(ROOT / "clients" / "python" / "src")]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if cache is not None:
        env["LOOM_CACHE_DIR"] = str(cache)
    return env


def run_bench(*args: str, cache: Path | None = None, timeout: float = 240) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "loom.cli", "bench", *args], capture_output=True, text=True,
                          env=bench_env(cache), timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    result: dict[str, Any] = json.loads(last)
    return result


# -- random-weight models -----------------------------------------------------------------------------------


def test_random_model_dir_holds_a_shape_and_no_weights(random_cache: Path) -> None:
    path = resolve_model_dir("random:tiny-llama")
    assert path.is_relative_to(random_cache)
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= {p.name for p in path.iterdir()}
    assert not list(path.glob("*.safetensors"))
    config = load_hf_config(path)
    assert random_weights_of(config) == RandomWeights(seed=0, std=0.02)
    assert resolve_model_dir("random:tiny-llama") == path  # cached
    big = json.loads((resolve_model_dir("random:llama-8b") / "config.json").read_text())
    assert (big["hidden_size"], big["intermediate_size"], big["num_hidden_layers"]) == (4096, 14336, 32)
    assert (big["num_key_value_heads"], big["vocab_size"], big["max_position_embeddings"]) == (8, 128256, 8192)
    assert (big["bos_token_id"], big["eos_token_id"], big["pad_token_id"]) == (1, 2, 0)
    with pytest.raises(ModelLoadError, match="random:llama-8b"):
        resolve_model_dir("random:nope")


def test_random_qwen3_30b_a3b_is_the_published_shape(random_cache: Path) -> None:
    """Qwen/Qwen3-30B-A3B's config.json: what W1/W2 of issue #22 run."""
    config = load_hf_config(resolve_model_dir("random:qwen3-30b-a3b"))
    assert config.architectures == ["Qwen3MoeForCausalLM"] and config.model_type == "qwen3_moe"
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim) == (2048, 48, 32, 4, 128)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size, config.norm_topk_prob,
            config.vocab_size) == (128, 8, 768, True, 151936)
    assert config.mlp_only_layers == [] and config.decoder_sparse_step == 1 and not config.tie_word_embeddings
    assert random_weights_of(config) == RandomWeights()


def test_moe_limits_count_what_a_step_reads(random_cache: Path) -> None:
    """Qwen3-30B-A3B in bf16: 61.06 GB of weights, of which a batch-1 decode step reads its 8 of 128
    experts a layer, the attention, router, norms and head: 6.08 GB; 256 sequences at once choose
    nearly every expert."""
    from loom.bench.limits import model_cost

    cost = model_cost(resolve_model_dir("random:qwen3-30b-a3b"), torch.bfloat16)
    assert cost.weight_bytes == pytest.approx(61.06e9, rel=1e-3)
    assert cost.expert_bytes == 48 * 128 * 3 * 2048 * 768 * 2 and cost.embedding_bytes == 151936 * 2048 * 2
    assert (cost.num_experts, cost.experts_per_token) == (128, 8)
    one = cost.step_weight_bytes(1)
    assert one == pytest.approx(cost.weight_bytes - cost.embedding_bytes - cost.expert_bytes * 120 / 128)
    assert one == pytest.approx(6.08e9, rel=2e-3)
    assert cost.step_weight_bytes(256) == pytest.approx(cost.weight_bytes - cost.embedding_bytes, rel=1e-6)
    # FLOPs: a token multiplies by its 8 experts (3.04B parameters with the head, the published "3.3B
    # activated" counts the embedding too).
    assert cost.body_matmul_params + cost.head_params == pytest.approx(3.04e9, rel=2e-3)
    hw = Hardware("cuda", "bfloat16", copy_bytes_per_s=4.3e12, matmul_flop_per_s=790e12)
    w1 = w1_limit(cost, hw, decode_w1())
    assert w1["min_decode_step_s"] == pytest.approx((one + cost.kv_bytes_per_token * 512) / 4.3e12)
    dense = model_cost(resolve_model_dir("random:llama-8b"), torch.bfloat16)
    assert dense.step_weight_bytes(1) == dense.weight_bytes == 16_060_522_496  # dense: every weight
    # --kv-cache-dtype fp8: 128 e4m3 codes and a float32 scale per row instead of 128 bf16 values
    fp8 = model_cost(resolve_model_dir("random:llama-8b"), torch.bfloat16, "fp8")
    assert (dense.kv_bytes_per_token, fp8.kv_bytes_per_token) == (2 * 32 * 8 * 128 * 2, 2 * 32 * 8 * 132)


def test_a_random_moe_model_generates_deterministically(random_cache: Path) -> None:
    from loom.engine.llm_engine import LLMEngine
    from loom.engine.types import EngineRequest, StoppingParams

    def generate() -> list[float]:
        engine = LLMEngine(EngineConfig(model_id="random:tiny-moe", device="cpu", max_batch_total_tokens=1024))
        engine.add_request(EngineRequest("r", tuple(range(10, 40)), stopping=StoppingParams(max_new_tokens=4,
                                                                                             ignore_eos=True)))
        logprobs: list[float] = []
        while engine.has_unfinished():
            logprobs += [lp for out in engine.step() for lp in out.logprobs]
        assert engine.info.architecture == "Qwen3MoeForCausalLM"
        return logprobs

    first = generate()
    assert len(first) == 4 and generate() == first


def _weights(registry: PluginRegistry, path: Path, weights: RandomWeights | None = None) -> dict[str, torch.Tensor]:
    loaded = load_model(path, torch.float32, "cpu", registry)
    if weights is not None:
        init_random_weights(loaded.model, weights)
    return {k: v.clone() for k, v in loaded.model.state_dict().items()}


def test_random_weights_are_a_function_of_the_seed(random_cache: Path, models_registry: PluginRegistry) -> None:
    path = resolve_model_dir("random:tiny-llama")
    first, second = _weights(models_registry, path), _weights(models_registry, path)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    other = _weights(models_registry, path, RandomWeights(seed=1))
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    norm = first["model.layers.0.input_layernorm.weight"]
    assert torch.equal(norm, torch.ones_like(norm))
    assert abs(first["model.layers.0.mlp.down_proj.weight"].std().item() - 0.02) < 0.002


def test_engine_generates_with_a_random_model_deterministically(random_cache: Path) -> None:
    from loom.engine.llm_engine import LLMEngine
    from loom.engine.types import EngineRequest, StoppingParams

    def generate() -> tuple[list[int], list[float]]:
        engine = LLMEngine(EngineConfig(model_id="random:tiny-llama", device="cpu", max_batch_total_tokens=4096))
        engine.add_request(EngineRequest("r", tuple(range(10, 40)), stopping=StoppingParams(max_new_tokens=6,
                                                                                             ignore_eos=True)))
        tokens: list[int] = []
        logprobs: list[float] = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens.extend(out.token_ids)
                logprobs.extend(out.logprobs)
        return tokens, logprobs

    first = generate()
    assert len(first[0]) == 6
    assert generate() == first  # same seed: the same logits (logprobs), so the same greedy tokens


# -- workloads, limits, serving statistics ------------------------------------------------------------------


def test_workloads_follow_the_definitions() -> None:
    w1 = decode_w1()
    assert [(len(p), n) for p, n in w1.requests] == [(512, 256)]
    w2 = gpu_workload("W2", "random:llama-1b")
    assert len(w2.requests) == 512 and all(n == 256 for _, n in w2.requests)
    assert len(gpu_workload("W2", "random:llama-8b").requests) == 256
    assert all(128 <= len(p) <= 1024 and all(10 <= t <= 1000 for t in p) for p, _ in w2.requests)
    assert serving_w2(3).requests == w2.requests[:3]  # request by request from one Random(2)
    assert serving_w3(3, 8).requests == [(p, 8) for p, _ in w2.requests[:3]]
    quick = gpu_workload("W2", "random:llama-8b", quick=True)
    assert len(quick.requests) == 16 and quick.requests[0][1] == 32


def test_physical_limits_match_the_workload_notes() -> None:
    # llama-8b on the H200 measured here: 16.06 GB at 4.3 TB/s -> 3.7 ms a decode step.
    cost = ModelCost(weight_bytes=16_060_522_496, body_matmul_params=6_979_321_856, head_params=525_336_576,
                     num_layers=32, num_heads=32, head_dim=128, kv_bytes_per_token=131072)
    hw = Hardware("cuda", "bfloat16", copy_bytes_per_s=4.3e12, matmul_flop_per_s=790e12)
    w1 = w1_limit(cost, hw, decode_w1())
    assert w1["min_decode_step_s"] == pytest.approx(3.75e-3, rel=0.01)
    assert 250 < w1["max_out_tok_s"] < 267
    w2 = w2_limit(cost, hw, gpu_workload("W2", "random:llama-8b"))
    assert w2["min_s"] == max(w2["flop_bound_s"], w2["byte_bound_s"])
    assert 3.0 < w2["min_s"] < 5.5  # WORKLOADS.md: "cannot end in under about 5.4 s" (a looser count)


def test_arrivals_and_serving_statistics() -> None:
    assert arrival_offsets(4, math.inf) == [0.0] * 4
    poisson = arrival_offsets(2000, 10.0, seed=3)
    assert poisson == arrival_offsets(2000, 10.0, seed=3) and poisson[0] == 0.0
    assert poisson[-1] / 1999 == pytest.approx(0.1, rel=0.1)
    w = Workload("W3", [([1] * 10, 3), ([1] * 20, 2)], "two")
    timings = [RequestTiming(0.0, [1.0, 1.5, 2.0]), RequestTiming(1.0, [1.5, 3.5])]
    s = summarize(timings, w)
    assert s["s"] == 3.5 and s["out_tokens"] == 5 and s["out_tok_s"] == pytest.approx(5 / 3.5)
    assert s["ttft_s"]["mean"] == pytest.approx(0.75)
    assert sorted([0.5, 2.0]) == sorted([(2.0 - 1.0) / 2, (3.5 - 1.5) / 1])  # TPOT = (E2E - TTFT)/(n-1)
    assert s["tpot_s"]["mean"] == pytest.approx(1.25)
    assert s["itl_s"]["p99"] == 2.0


def test_sustained_throughput_separates_keeping_up_from_falling_behind() -> None:
    """W3 with Poisson arrivals: the run totals include the drain, so they read below the offered
    load even for a server that keeps up; the sustained share compares completion and arrival spans."""
    w = Workload("W3", [([1] * 4, 4)] * 20, "twenty")

    def run(latency: Callable[[int], float]) -> dict[str, Any]:
        timings = [RequestTiming(0.5 * i, [0.5 * i + latency(i) * (j + 1) / 4 for j in range(4)]) for i in range(20)]
        return summarize(timings, w)

    keeps_up = run(lambda i: 3.0)  # every request takes 3 s: completions as fast as arrivals
    assert keeps_up["sustained"]["offered_request_s"] == pytest.approx(2.0)
    assert keeps_up["sustained"]["share"] == pytest.approx(1.0)
    assert keeps_up["sustained"]["served_out_tok_s"] == pytest.approx(8.0)
    assert keeps_up["out_tok_s"] == pytest.approx(0.8 * keeps_up["sustained"]["offered_out_tok_s"])  # the drain
    behind = run(lambda i: 3.0 + 0.25 * i)  # a queue grows: each request waits longer
    assert behind["sustained"]["share"] == pytest.approx(9.5 / 14.25)
    at_once = summarize([RequestTiming(0.0, [1.0]), RequestTiming(0.0, [2.0])], Workload("W3", [([1], 1)] * 2, ""))
    assert at_once["sustained"] is None


def test_cpu_benchmarks_hold_every_request_of_a_workload_in_the_pool() -> None:
    """The CPU figures measure batching: the pool is not the engine's small default."""
    import argparse

    from loom.bench.command import cpu_pool_tokens, engine_config

    w = Workload("x", [([1] * 10, 6), ([1] * 20, 20)], "two")
    assert cpu_pool_tokens([w]) == 16 + 48  # whole 16-token blocks
    c2 = cpu_workload("C2")
    assert cpu_pool_tokens([c2]) >= sum(len(p) + n for p, n in c2.requests) > 4 * 1024
    args = argparse.Namespace(model_id="random:tiny-llama", dtype="auto", attention_backend=None, quantize="auto",
                              kv_cache_dtype="auto", max_step_latency_ms=None, speculate=None,
                              max_total_tokens=2048, max_batch_prefill_tokens=None, max_batch_total_tokens=None,
                              threads=2, cuda_memory_fraction=None, async_scheduling=None, cuda_graphs=None)
    cfg = engine_config(args, torch.device("cpu"), [w])
    assert cfg.max_batch_total_tokens == 2048  # at least one full-length request
    big = Workload("y", [([1] * 500, 500)] * 8, "eight")
    assert engine_config(args, torch.device("cpu"), [big]).max_batch_total_tokens == 8 * 1008
    args.max_batch_total_tokens = 4096
    assert engine_config(args, torch.device("cpu"), [big]).max_batch_total_tokens == 4096  # the flag wins


def test_serve_args_carry_the_engine_config() -> None:
    cfg = EngineConfig(model_id="random:tiny-llama", device="cpu", max_total_tokens=2048, num_threads=2)
    args = serve_args(cfg, 1234, 200)
    pairs = dict(zip(args[::2], args[1::2], strict=True))
    pairs.pop("--prometheus-port", None)
    assert pairs == {"--host": "127.0.0.1", "--port": "1234", "--max-concurrent-requests": "200",
                     "--model-id": "random:tiny-llama", "--device": "cpu", "--max-total-tokens": "2048",
                     "--num-threads": "2"}


# -- the command, end to end --------------------------------------------------------------------------------


@pytest.mark.slow
def test_bench_c0_quick_keeps_its_json_shape(default_model_dir: Path) -> None:
    result = run_bench("--workloads", "C0", "--quick")
    assert set(result) == {"command", "loom_version", "machine", "date", "model", "threads", "quick", "workloads",
                           "cpu_engine"}
    assert result["command"] == "loom bench --workloads C0 --quick"
    from loom_plugins.quant.gguf import kernel_available

    # the embedded GGUF runs on its own blocks wherever the kernel builds, and the result says so
    assert result["cpu_engine"]["plugins"] == (["quantizer:gguf"] if kernel_available() else [])
    c0 = result["workloads"]["C0"]
    assert c0["loom"]["out_tokens"] == 8 and c0["loom"]["out_tok_s"] > 0


@pytest.mark.slow
def test_bench_w1_w2_quick_on_a_random_model(tmp_path: Path) -> None:
    result = run_bench("--workloads", "W1,W2", "--model-id", "random:tiny-llama", "--quick", "--device", "cpu",
                       "--w2-requests", "3", cache=tmp_path)
    assert result["engine"]["model_id"] == "random:tiny-llama"
    assert result["limits"]["hardware"]["copy_bytes_per_s"] > 0
    for name, out_tokens in (("W1", 32), ("W2", 3 * 32)):
        entry = result["workloads"][name]
        assert entry["loom"]["out_tokens"] == out_tokens
        assert 0 < entry["ratio_to_limit"] < 1
    # W6's columns: the weights as served and the KV pool they left
    memory = result["memory"]
    assert memory["weights"]["weight_bytes"] == result["limits"]["model"]["weight_bytes"]  # dense: every parameter
    assert memory["kv_pool"]["tokens"] == result["engine"]["max_batch_total_tokens"] > 0
    assert memory["kv_pool"]["bytes"] == memory["kv_pool"]["tokens"] * result["limits"]["model"]["kv_bytes_per_token"]


@pytest.mark.slow
def test_bench_w1_quick_with_int4_weights_reports_the_int4_limit(tmp_path: Path) -> None:
    result = run_bench("--workloads", "W1", "--model-id", "random:tiny-llama", "--quick", "--device", "cpu",
                       "--quantize", "gptq", cache=tmp_path)
    assert "quantizer:gptq?" in result["engine"]["plugins"][0]
    weights = result["memory"]["weights"]
    assert weights["quantization"] == "gptq" and weights["weight_bytes"] < result["limits"]["model"]["weight_bytes"]
    entry = result["workloads"]["W1"]
    assert entry["limit"]["min_decode_step_s"] < entry["limit_dense_weights"]["min_decode_step_s"]
    assert entry["ratio_to_limit"] == entry["loom"]["out_tok_s"] / entry["limit"]["max_out_tok_s"]


def test_bench_w4_quick_runs_cache_on_and_off(tmp_path: Path) -> None:
    result = run_bench("--workloads", "W4", "--model-id", "random:tiny-llama", "--quick", "--device", "cpu",
                       cache=tmp_path)
    entry = result["workloads"]["W4"]
    for label in ("cache_on", "cache_off"):
        assert entry[label]["out_tokens"] == 4 * 4
        assert entry[label]["ttft_p50_s"] > 0
    assert entry["ttft_p50_speedup"] == entry["cache_off"]["ttft_p50_s"] / entry["cache_on"]["ttft_p50_s"]


def test_gpu_peer_measurements_run_on_cpu(random_cache: Path) -> None:
    """hf_peer.py's measurements, on the tiny shape and tiny counts (the code path, not speed)."""
    from loom.bench.peer_hf import build_hf_model, continuous_batching, static_generate

    path = resolve_model_dir("random:tiny-llama")
    cpu = torch.device("cpu")
    model = build_hf_model(path, torch.float32, cpu)
    static = static_generate(model, cpu, 2, 16, 4)
    assert static["out_tokens"] == 8 and static["out_tok_s"] > 0
    # generate_batch() itself takes half a minute to set up on CPU: stand-ins check our side of it.
    w = Workload("W2", [(p[:20], 3) for p, _ in serving_w2(2).requests], "two tiny requests")
    done = SimpleNamespace(generated_tokens=[5, 6, 7])
    fake: Any = model
    fake.set_attn_implementation = lambda name: None
    fake.generate_batch = lambda **kw: {"a": done, "b": done}
    cb = continuous_batching(model, cpu, w)
    assert cb["out_tokens"] == 6 and cb["done"] == 2 and cb["total_tok_s"] > cb["out_tok_s"] > 0
    fake.generate_batch = lambda **kw: {"a": done}
    assert "1 of 2 requests" in continuous_batching(model, cpu, w)["error"]  # failed requests are logged only

    def missing(**kw: Any) -> None:
        raise AttributeError("no generate_batch in this transformers")

    fake.generate_batch = missing
    assert "no generate_batch" in continuous_batching(model, cpu, w)["error"]


@pytest.mark.slow
@pytest.mark.e2e
def test_bench_w3_quick_through_a_real_server(tmp_path: Path) -> None:
    result = run_bench("--workloads", "W3", "--model-id", "random:tiny-llama", "--quick", "--device", "cpu",
                       "--w3-repeats", "2", cache=tmp_path)
    w3 = result["workloads"]["W3"]
    assert [r["order"] for r in w3["runs"]] == ["grpc, engine", "engine, grpc"]  # order alternates
    assert w3["server"].startswith("loom serve ")
    for side in ("grpc", "engine"):
        assert w3[side]["requests"] == 4 and w3[side]["out_tokens"] == 4 * 8
        assert w3[side]["ttft_s"]["p50"] > 0 and w3[side]["e2e_s"]["p99"] >= w3[side]["ttft_s"]["p99"]
    means = [sum(r[f"{side}_out_tok_s"] for r in w3["runs"]) / 2 for side in ("grpc", "engine")]
    assert w3["grpc_overhead"] == pytest.approx(1 - means[0] / means[1])


@pytest.mark.slow
def test_a_peer_out_of_time_gives_a_bound_not_a_figure(random_cache: Path) -> None:
    """--peer-w2-timeout-s: the peer's W2 runs in a child process from which only a bound comes back
    when it has not finished (here it cannot: 1 ms), and Loom's ratio then is a lower bound."""
    from loom.bench.peer_hf import bounded_continuous_batching

    w = Workload("W2", [([5, 6, 7, 8], 6), ([9, 10, 11], 6)], "two requests")
    out = bounded_continuous_batching(resolve_model_dir("random:tiny-llama"), torch.float32, torch.device("cpu"),
                                      w, timeout_s=0.001)
    assert out["timed_out"] is True and "out_tok_s" not in out
    assert out["out_tok_s_at_most"] == pytest.approx(12 / 0.001)


@pytest.mark.parametrize("flag, value, message", [
    ("--peer-w2-timeout-s", "0", "--peer-w2-timeout-s takes seconds > 0"),
    ("--peer-static-batches", "64,x", "--peer-static-batches takes comma-separated integers"),
])
def test_bad_peer_options_are_refused_before_anything_runs(flag: str, value: str, message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "loom.cli", "bench", "--workloads", "W2", "--model-id",
                           "random:tiny-llama", "--device", "cpu", "--peer", "hf", flag, value],
                          capture_output=True, text=True, env=bench_env(), timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert "engine ready" not in proc.stdout + proc.stderr
