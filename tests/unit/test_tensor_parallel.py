"""Tensor parallelism on the CPU (gloo ranks): sharded engines give one shard's outputs.

Each test starts real rank processes (``--num-shard N``: rank 0 in this process, the others
spawned) and runs one workload through a sharded engine and a one-shard engine of the same
model. fp32 on the CPU: the tokens must be equal; the logprobs may differ by the rounding of the
all-reduce's different summation order (rank partial sums added, instead of one GEMM's sum), so
they are compared within ``LOGPROB_TOL`` (measured: below 2e-6 on these models).

The workload covers greedy and seeded sampling with every sampling parameter (temperature,
top-k, top-p, typical-p, min-p, the three penalties, top-n alternatives, prompt logprobs, min
new tokens, stop ids), n > 1, prefix caching (two prompts sharing blocks) and, in a pool too
small for the batch, preemption and recomputation.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from loom.config import ConfigError, EngineConfig
from loom.distributed.errors import ShardLostError
from loom.distributed.shard_check import shard_problems
from loom.engine.llm_engine import LLMEngine
from loom.engine.types import EngineRequest, SamplingParams, StoppingParams
from loom.worker.sharded_worker import ShardedWorker

LOGPROB_TOL = 2e-5
TinyDir = Callable[[str], Path]

_PREFIX = (5, 9, 13, 17, 21, 25, 29, 33, 37, 41)  # 10 tokens: 2 whole 4-token blocks shared


def _requests(vocab: int) -> list[EngineRequest]:
    stop = StoppingParams(max_new_tokens=10, ignore_eos=True)
    every = SamplingParams(do_sample=True, temperature=0.8, top_k=40, top_p=0.9, typical_p=0.95, min_p=0.02,
                           seed=11, repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2,
                           top_n_tokens=3, prompt_logprobs=True)
    return [
        EngineRequest("greedy", (*_PREFIX, 50, 51), SamplingParams(top_n_tokens=2), stop),
        EngineRequest("shares-prefix", (*_PREFIX, 60), SamplingParams(), stop),
        EngineRequest("every-param", (3, 4, 5, 6, 7), every,
                      StoppingParams(max_new_tokens=9, min_new_tokens=3, stop_token_ids=(vocab - 1,))),
        EngineRequest("seeded-n3", (8, 9, 10), SamplingParams(do_sample=True, temperature=1.3, seed=5), stop, n=3),
        EngineRequest("hot", (100 % vocab, 7, 7, 7), SamplingParams(do_sample=True, temperature=2.0, top_p=0.5, seed=9),
                      StoppingParams(max_new_tokens=12, ignore_eos=True)),
    ]


Outputs = dict[tuple[str, int], dict[str, Any]]


def _run(engine: LLMEngine, reqs: list[EngineRequest]) -> Outputs:
    out: Outputs = {}
    for req in reqs:
        engine.add_request(req)
    while engine.has_unfinished():
        for o in engine.step():
            rec = out.setdefault((o.request_id, o.index), {"tokens": [], "logprobs": [], "top": [],
                                                            "prompt": None, "finish": None})
            rec["tokens"] += o.token_ids
            rec["logprobs"] += o.logprobs
            rec["top"] += o.top_tokens or []
            if o.prompt_logprobs is not None:
                rec["prompt"] = o.prompt_logprobs
            assert o.error is None, o.error
            if o.finish_reason is not None:
                rec["finish"] = o.finish_reason
    return out


def _close(a: float | None, b: float | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and abs(a - b) <= LOGPROB_TOL)


def assert_same_outputs(sharded: Outputs, single: Outputs) -> None:
    assert sharded.keys() == single.keys()
    for key, ref in single.items():
        got = sharded[key]
        assert got["tokens"] == ref["tokens"], key
        assert got["finish"] == ref["finish"], key
        assert all(_close(a, b) for a, b in zip(got["logprobs"], ref["logprobs"], strict=True)), key
        assert [[t for t, _ in alts] for alts in got["top"]] == [[t for t, _ in alts] for alts in ref["top"]], key
        for alts, ref_alts in zip(got["top"], ref["top"], strict=True):
            assert all(_close(a, b) for (_, a), (_, b) in zip(alts, ref_alts, strict=True)), key
        if ref["prompt"] is not None:
            assert all(_close(a, b) for a, b in zip(got["prompt"], ref["prompt"], strict=True)), key


def _engine(path: Path, **kw: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(model_id=str(path), block_size=4, **kw))


def _compare(path: Path, num_shard: int, vocab: int, **kw: Any) -> tuple[LLMEngine, LLMEngine, Outputs, Outputs]:
    single = _engine(path, **kw)
    ref = _run(single, _requests(vocab))
    sharded = _engine(path, num_shard=num_shard, **kw)
    try:
        got = _run(sharded, _requests(vocab))
        assert_same_outputs(got, ref)
    finally:
        sharded.close()
    return single, sharded, got, ref


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "llama-mqa", "qwen3-moe"])
def test_two_shards_give_one_shards_outputs(name: str, tiny_model_dir: TinyDir) -> None:
    """q/k/v, gate/up, o, down, the embedding and the head split over 2 ranks (llama-mqa: its
    one KV head replicated on both); qwen3 ties the head to the embedding; qwen3-moe splits each
    expert's intermediate size (an all-reduce after the experts)."""
    single, sharded, got, _ = _compare(tiny_model_dir(name), 2, 320)
    assert sharded.info.num_shard == 2 and single.info.num_shard == 1
    assert sharded.block_manager.num_blocks == single.block_manager.num_blocks  # the same pool
    assert sharded.stats().prefix_cache_hits > 0  # the shared prefix was served from the cache
    assert {i for rid, i in got if rid == "seeded-n3"} == {0, 1, 2}
    assert isinstance(sharded.worker, ShardedWorker)
    assert all(p.poll() is not None for p in sharded.worker.procs)  # closed: no rank left behind


def test_sharded_worker_of_one_rank_matches_the_plain_worker(tiny_model_dir: TinyDir,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """World size 1 through the sharded worker (gloo; no command ring, which needs a reader):
    the CPU twin of the NCCL test in tests/gpu/test_tensor_parallel_gpu.py."""
    import loom.engine.llm_engine as llm_engine

    path = tiny_model_dir("llama")
    ref = _run(_engine(path), _requests(320))
    monkeypatch.setattr(llm_engine, "Worker", lambda config, registry: ShardedWorker(config, registry))
    engine = _engine(path)
    try:
        assert isinstance(engine.worker, ShardedWorker) and engine.worker.ring is None
        assert_same_outputs(_run(engine, _requests(320)), ref)
    finally:
        engine.close()


def test_two_shards_preempt_and_recompute_like_one(tiny_model_dir: TinyDir) -> None:
    """A pool of 12 blocks for a batch that needs more: sequences are preempted and recomputed."""
    single, sharded, _, _ = _compare(tiny_model_dir("llama"), 2, 320, max_batch_total_tokens=48,
                                     max_total_tokens=40)
    assert single.scheduler.num_preemptions > 0
    assert sharded.scheduler.num_preemptions == single.scheduler.num_preemptions


def test_two_shards_with_a_draft_model_speculate_like_one(tiny_model_dir: TinyDir) -> None:
    """A draft model (the speculator's own worker) is built whole, as one rank of one, in the
    engine process: its layers never wait on the other ranks, and verification steps are
    broadcast like any step."""
    draft = (("model_id", str(tiny_model_dir("llama"))),)
    single, sharded, _, _ = _compare(tiny_model_dir("llama"), 2, 320, speculate=2, speculator="draft",
                                     speculator_options=draft)
    assert sharded.speculator is not None and single.speculator is not None


@pytest.mark.parametrize("fmt", ["gptq", "awq", "fp8"])
def test_quantized_two_shards_give_one_shards_outputs(fmt: str, tiny_model_dir: TinyDir, tmp_path: Path) -> None:
    """GPTQ (4 bits, groups of 32) and AWQ (groups of 32): each rank keeps its rows of the packed
    weights, scales and zeros in column-parallel layers and its whole groups of input rows in
    row-parallel ones (o_proj: one group per rank). FP8 (compressed-tensors, per-channel static
    scales): the rows' scales follow the rows; the activations' per-tensor scales are copied."""
    from helpers.quant_checkpoints import awq_checkpoint, fp8_checkpoint, gptq_checkpoint

    dense = tiny_model_dir("llama")
    if fmt == "gptq":
        path, _ = gptq_checkpoint(dense, tmp_path / fmt, bits=4, group=32, sym=True)
    elif fmt == "awq":
        path, _ = awq_checkpoint(dense, tmp_path / fmt, group=32)
    else:
        path, _ = fp8_checkpoint(dense, tmp_path / fmt, per_channel=True, static=True)
    single, sharded, _, _ = _compare(path, 2, 320)
    assert single.worker.info.quantization == sharded.worker.info.quantization
    assert single.worker.info.quantization is not None


def test_smollm2_three_shards_give_one_shards_outputs(default_model_dir: Path) -> None:
    """The real SmolLM2-135M: 9 heads and 3 KV heads over 3 ranks (dense weights: the GGUF
    kernels serve one rank only, so both engines run --quantize none)."""
    reqs = [EngineRequest("greedy", (1, 504, 3060, 314, 260, 2137), SamplingParams(),
                          StoppingParams(max_new_tokens=8, ignore_eos=True)),
            EngineRequest("seeded", (1, 504, 3060), SamplingParams(do_sample=True, temperature=0.9, top_p=0.95,
                                                                   seed=4), StoppingParams(max_new_tokens=8,
                                                                                           ignore_eos=True))]
    config = dict(model_id=str(default_model_dir), quantize="none", max_total_tokens=64,
                  max_batch_total_tokens=256)
    ref = _run(LLMEngine(EngineConfig(**config)), reqs)
    sharded = LLMEngine(EngineConfig(num_shard=3, **config))
    try:
        got = _run(sharded, [EngineRequest(r.request_id, r.prompt_token_ids, r.sampling, r.stopping) for r in reqs])
    finally:
        sharded.close()
    assert_same_outputs(got, ref)


def test_constrained_two_shards_give_one_shards_outputs(default_model_dir: Path, tmp_path: Path) -> None:
    """Structured output over 2 ranks, steps overlapped: each constrained step sends its forward,
    then its grammar rows (filled on rank 0 while the ranks run the forward) as a second command;
    every rank masks and samples the same tokens."""
    pytest.importorskip("xgrammar")
    from helpers.tiny_models import save_tiny_llama_with_vocab_of

    from loom.structured.spec import GrammarSpec

    path = save_tiny_llama_with_vocab_of(default_model_dir, tmp_path / "tiny-vocab")
    regex = GrammarSpec("regex", "[a-c]{2,6}", "parameters.constraint.regex")
    choice = GrammarSpec("ebnf", 'root ::= "yes" | "no" | "maybe"', "parameters.constraint.grammar")
    stop = StoppingParams(max_new_tokens=12)
    prompt = (1, 504, 3458, 28, 253)
    reqs = [EngineRequest("regex", prompt, SamplingParams(constraint=regex, do_sample=True, seed=3), stop, n=2),
            EngineRequest("choice", prompt, SamplingParams(constraint=choice), stop),
            EngineRequest("plain", prompt, SamplingParams(), StoppingParams(max_new_tokens=6, ignore_eos=True))]
    config = dict(model_id=str(path), max_batch_total_tokens=1024, async_scheduling="on", warmup=False)
    ref = _run(LLMEngine(EngineConfig(**config)), reqs)  # type: ignore[arg-type]
    sharded = LLMEngine(EngineConfig(num_shard=2, **config))  # type: ignore[arg-type]
    try:
        got = _run(sharded, reqs)
        assert sharded.num_async_steps > 0
    finally:
        sharded.close()
    assert_same_outputs(got, ref)


def test_smollm2_two_shards_refused_at_start_naming_the_numbers(default_model_dir: Path) -> None:
    with pytest.raises(ConfigError) as err:
        LLMEngine(EngineConfig(model_id=str(default_model_dir), num_shard=2))
    message = str(err.value)
    assert "--num-shard 2" in message
    assert "9 attention heads are not divisible by 2" in message
    assert "3 KV heads are not divisible by 2" in message


def test_shard_problems_name_every_number() -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, intermediate_size=100)
    assert shard_problems(config, 1) == []
    assert shard_problems(config, 2) == []
    three = shard_problems(config, 3)
    assert "3 is not a multiple of the 2 KV heads (each rank needs whole, replicated KV heads)" in three[0]
    assert "intermediate_size 100 is not divisible by 3" in three[1]
    assert any("6 attention heads are not divisible by 4" in p for p in shard_problems(config, 4))
    assert shard_problems(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=128,
                                      quantization_config={"group_size": 64}), 2) == [
        "o_proj's input per rank (64 / 2 = 32) is not a whole number of quantization groups of 64"]
    # act-order: a rank keeps every group's scales, so its inputs need not be whole groups
    assert shard_problems(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=128, quantization_config={
                                          "quant_method": "gptq", "group_size": 64, "desc_act": True}), 2) == []


def test_a_hung_rank_is_named_within_the_step_timeout(tiny_model_dir: TinyDir) -> None:
    """A rank stopped (SIGSTOP) in the middle of serving: the watchdog names it once a step has
    waited --shard-step-timeout for it, kills the ranks, and the step raises ShardLostError
    (never a request's failure, never a silent hang)."""
    failures: list[str] = []
    engine = LLMEngine(EngineConfig(model_id=str(tiny_model_dir("llama")), block_size=4, num_shard=2,
                                    shard_step_timeout=2.0), on_shard_failure=failures.append)
    assert isinstance(engine.worker, ShardedWorker)
    rank1 = engine.worker.procs[0]
    try:
        engine.add_request(EngineRequest("r", (5, 6, 7), SamplingParams(),
                                         StoppingParams(max_new_tokens=50, ignore_eos=True)))
        engine.step()
        os.kill(rank1.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(ShardLostError, match="tensor-parallel rank 1"):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - started < 20
        assert failures and "rank 1 did not finish command" in failures[0], failures
        assert rank1.poll() is not None  # killed, not left stopped
    finally:
        engine.close()


def test_preflight_refuses_a_shard_count_before_loading(tiny_model_dir: TinyDir) -> None:
    """`loom serve` checks a model directory's config.json before the engine starts (exit 2)."""
    from loom.preflight import check_engine_config

    path = str(tiny_model_dir("llama"))  # 4 heads, 2 KV heads, intermediate 128
    check_engine_config(EngineConfig(model_id=path, num_shard=2))
    with pytest.raises(ConfigError, match="--num-shard 3 cannot split this model: 4 attention heads are not "
                                          "divisible by 3; 3 is not a multiple of the 2 KV heads"):
        check_engine_config(EngineConfig(model_id=path, num_shard=3))


def test_loom_plugins_shows_how_many_shards_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from loom.plugin_api.command import shard_capacity_line, visible_gpus

    gpus = tmp_path / "gpus"
    for bus in ("0000:01:00.0", "0000:02:00.0", "0000:03:00.0"):
        (gpus / bus).mkdir(parents=True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpus(gpus) == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert visible_gpus(gpus) == 2
    assert visible_gpus(tmp_path / "none") == 0
    assert "up to 2 on the 2 GPUs visible here (NCCL, one per shard)" in shard_capacity_line(2)
    assert "no GPU visible here; any N of gloo shards with --device cpu" in shard_capacity_line(0)


@pytest.mark.parametrize("group", [32, 64])
def test_gptq_act_order_two_shards_give_one_shards_outputs(group: int, tiny_model_dir: TinyDir,
                                                           tmp_path: Path) -> None:
    """GPTQ act-order (desc_act, g_idx a random order of the inputs): column-parallel layers keep
    their rows; a row-parallel rank keeps its slice of qweight's input rows and of g_idx, and every
    group's scales and zeros (its inputs belong to groups scattered over the whole input). Group 64
    leaves o_proj's ranks 32 inputs each: parts of groups, which act-order allows."""
    from helpers.quant_checkpoints import gptq_checkpoint

    path, _ = gptq_checkpoint(tiny_model_dir("llama"), tmp_path / "gptq", bits=4, group=group, sym=False,
                              desc_act=True)
    single, sharded, _, _ = _compare(path, 2, 320)
    assert sharded.worker.info.quantization == single.worker.info.quantization
    assert single.worker.info.quantization is not None


@pytest.mark.parametrize(("group", "sym", "actorder"), [(32, True, None), (32, False, None), (64, False, "group")])
def test_compressed_tensors_pack_quantized_two_shards_give_one_shards_outputs(
        group: int, sym: bool, actorder: str | None, tiny_model_dir: TinyDir, tmp_path: Path) -> None:
    """compressed-tensors pack-quantized (the wna16 quantizer): ``weight_packed [out, in / 8]``
    splits like a dense weight; asymmetric zero points ``[out / 8, G]`` by packed rows; with a
    g_idx (``actorder: group``, group 64: o_proj's ranks hold parts of groups) every rank keeps
    every group's scales and zeros, as GPTQ act-order does."""
    from helpers.quant_checkpoints import wna16_checkpoint

    # (asymmetric: the head too, its zero points 8 vocabulary rows a word, each rank its 160 rows)
    path, _ = wna16_checkpoint(tiny_model_dir("llama"), tmp_path / "ct", group=group, sym=sym, actorder=actorder,
                               lm_head=not sym)
    single, sharded, _, _ = _compare(path, 2, 320)
    assert single.worker.info.quantization == sharded.worker.info.quantization == "wna16"
    if actorder is None:  # groups of 64 without a g_idx: o_proj's 32 inputs a rank are refused at start
        grouped, _ = wna16_checkpoint(tiny_model_dir("llama"), tmp_path / "ct64", group=64, sym=sym)
        with pytest.raises(ConfigError, match=r"o_proj's input per rank \(64 / 2 = 32\) is not a whole number "
                                              r"of quantization groups of 64"):
            _engine(grouped, num_shard=2)


@pytest.mark.parametrize("model", ["llama", "qwen3"])
def test_gptq_quantized_head_two_shards_give_one_shards_outputs(model: str, tiny_model_dir: TinyDir,
                                                                tmp_path: Path) -> None:
    """A GPTQ head (``lm_head: true``; qwen3's was tied): each rank keeps its vocabulary columns of
    ``qweight [H / 8, V]`` and ``scales``, and its packed columns of ``qzeros [G, V / 8]``."""
    from helpers.quant_checkpoints import gptq_checkpoint

    path, _ = gptq_checkpoint(tiny_model_dir(model), tmp_path / "gptq", bits=4, group=32, lm_head=True)
    single, sharded, _, _ = _compare(path, 2, 320)
    assert single.worker.info.quantization == sharded.worker.info.quantization == "gptq"
    with pytest.raises(ConfigError, match=r"--num-shard 3 cannot split this model: .*the quantized head's vocabulary "
                                          r"per rank \(ceil\(320 / 3\) = 107\) is not a multiple of the 8 columns"):
        _engine(path, num_shard=3)


@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_two_shards_give_one_shards_outputs(double_quant: bool, tiny_model_dir: TinyDir,
                                                tmp_path: Path) -> None:
    """bitsandbytes NF4 (blocks of 64; double-quantized absmax decoded at load): a column-parallel
    rank cuts its rows out of the flat codes and absmax, a row-parallel rank its inputs (whole
    blocks: 128 / 2 and 256 / 2 inputs are multiples of 64)."""
    pytest.importorskip("bitsandbytes")
    from helpers.quant_checkpoints import nf4_checkpoint

    path, _ = nf4_checkpoint(tiny_model_dir("llama-wide"), tmp_path / "nf4", double_quant=double_quant)
    single, sharded, _, _ = _compare(path, 2, 320)
    assert sharded.worker.info.quantization == single.worker.info.quantization
    assert single.worker.info.quantization is not None


def test_nf4_blocks_that_straddle_a_rank_are_refused(tiny_model_dir: TinyDir, tmp_path: Path) -> None:
    """The 64-wide llama's o_proj gives each of 2 ranks 32 inputs: half of each block of 64."""
    pytest.importorskip("bitsandbytes")
    from helpers.quant_checkpoints import nf4_checkpoint

    from loom.model_loader import ModelLoadError

    path, _ = nf4_checkpoint(tiny_model_dir("llama"), tmp_path / "nf4", double_quant=True)
    with pytest.raises(ModelLoadError, match=r"o_proj: --num-shard 2 leaves each rank 32 of its 64 inputs, "
                                             r"not whole NF4 blocks of 64"):
        _engine(path, num_shard=2)
