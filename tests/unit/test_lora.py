"""LoRA adapters in the engine (loom.lora): greedy tokens equal peft's merged model for each
adapter alone and for a batch mixing adapters and the base model; refused adapters; the prefix
cache kept apart per adapter; unloads refused while in use; quantized base layers."""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from loom.config import ConfigError, EngineConfig
from loom.engine.llm_engine import LLMEngine, RequestRejected
from loom.engine.types import AdapterCommand, EngineOutput, EngineRequest, SamplingParams, StoppingParams
from tests.helpers.lora_adapters import greedy_tokens, merged_model, save_peft_adapter

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# name -> (rank, alpha, targets, rsLoRA)
ADAPTERS: dict[str, tuple[int, float, tuple[str, ...], bool]] = {
    "qv": (8, 16, ("q_proj", "v_proj"), False),
    "all": (4, 8, ALL, True),
    "mlp": (16, 8, ("o_proj", "gate_proj", "up_proj", "down_proj"), False),
}
PROMPTS = {"qv": (5, 9, 33, 7, 81, 12, 3), "all": (40, 41, 42, 17, 5), "mlp": (8, 100, 200, 250, 9, 11),
           "": (60, 61, 70, 5, 5, 9, 19)}
NEW = 10


@pytest.fixture(scope="module")
def tiny_adapters(tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("adapters")
    return {name: save_peft_adapter(base, root / name, r=r, alpha=alpha, targets=t, use_rslora=rs, seed=i)
            for i, (name, (r, alpha, t, rs)) in enumerate(ADAPTERS.items())}


def _engine(model_dir: Path, adapters: dict[str, Path], **kw: Any) -> LLMEngine:
    kw.setdefault("max_batch_total_tokens", 1024)
    return LLMEngine(EngineConfig(model_id=str(model_dir), block_size=4, warmup=False,
                                  lora_adapters=tuple((n, str(p)) for n, p in adapters.items()), **kw))


def _request(rid: str, prompt: tuple[int, ...], adapter: str, new: int = NEW) -> EngineRequest:
    return EngineRequest(rid, prompt, SamplingParams(), StoppingParams(max_new_tokens=new, ignore_eos=True),
                         adapter_id=adapter)


def _run(engine: LLMEngine, requests: list[EngineRequest]) -> dict[str, list[EngineOutput]]:
    got: dict[str, list[EngineOutput]] = {}
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).append(out)
    return got


def _tokens(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def test_greedy_equals_peft_merged_alone_and_mixed(tiny_model_dir: Callable[[str], Path],
                                                   tiny_adapters: dict[str, Path]) -> None:
    base = tiny_model_dir("llama")
    expected = {name: greedy_tokens(merged_model(base, tiny_adapters.get(name)), PROMPTS[name], NEW)
                for name in PROMPTS}
    # The adapters change what the model says (else this test could not fail).
    base_on_their_prompts = {n: greedy_tokens(merged_model(base, None), PROMPTS[n], NEW) for n in ADAPTERS}
    assert all(base_on_their_prompts[n] != expected[n] for n in ADAPTERS)
    engine = _engine(base, tiny_adapters)
    assert [a.name for a in engine.info.adapters] == sorted(ADAPTERS)
    assert {a.name: a.rank for a in engine.info.adapters} == {n: v[0] for n, v in ADAPTERS.items()}
    for name, prompt in PROMPTS.items():  # each alone
        got = _run(engine, [_request(f"alone-{name}", prompt, name)])
        assert _tokens(got[f"alone-{name}"]) == expected[name], name
    # All together in one batch (fresh engine: no prefix-cache hits), plans keep plain slots.
    mixed = _engine(base, tiny_adapters, enable_prefix_caching=False)
    plans: list[Any] = []
    execute = mixed.worker.execute
    mixed.worker.execute = lambda plan: (plans.append(pickle.loads(pickle.dumps(plan))), execute(plan))[1]  # type: ignore[method-assign]
    got = _run(mixed, [_request(f"mix-{n}", p, n) for n, p in PROMPTS.items()])
    for name in PROMPTS:
        assert _tokens(got[f"mix-{name}"]) == expected[name], name
    assert plans[0].lora_slots is not None and len(set(plans[0].lora_slots)) == 4  # three adapters and the base


def test_smollm2_adapters_equal_peft_merged(default_model_dir: Path, tmp_path: Path) -> None:
    adapters = {"a": save_peft_adapter(default_model_dir, tmp_path / "a", r=8, alpha=16, targets=ALL, seed=1,
                                       scale=0.05),
                "b": save_peft_adapter(default_model_dir, tmp_path / "b", r=4, alpha=4,
                                       targets=("q_proj", "v_proj", "down_proj"), seed=2, scale=0.08)}
    prompt = (1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 198)
    expected = {n: greedy_tokens(merged_model(default_model_dir, adapters.get(n)), prompt, 8) for n in ("a", "b", "")}
    assert expected["a"] != expected[""] and expected["b"] != expected[""]
    engine = _engine(default_model_dir, adapters, max_batch_total_tokens=512)
    got = _run(engine, [_request(f"r-{n}", prompt, n, 8) for n in ("a", "b", "")])
    assert {n: _tokens(got[f"r-{n}"]) for n in ("a", "b", "")} == expected


def test_unknown_adapter_is_refused_not_served_by_the_base(make_engine: Callable[..., LLMEngine],
                                                           tiny_adapters: dict[str, Path]) -> None:
    engine = make_engine(warmup=False, max_batch_total_tokens=256, max_loras=2)
    with pytest.raises(RequestRejected, match="'nope'") as info:
        engine.add_request(_request("x", (5, 6, 7), "nope"))
    assert info.value.rejection.status == "NOT_FOUND" and info.value.rejection.field == "adapter_id"
    off = make_engine(warmup=False, max_batch_total_tokens=256)
    with pytest.raises(RequestRejected, match="'qv'"):
        off.add_request(_request("y", (5, 6, 7), "qv"))


def _load(engine: LLMEngine, name: str, path: Path | str) -> Any:
    reply = engine.adapter_command(AdapterCommand(1, name, str(path)))
    while reply is None:
        replies = engine.adapter_replies()
        reply = replies[0] if replies else None
    return reply


def _write_bad(tmp: Path, source: Path, name: str, edit: Callable[[dict[str, Any], dict[str, torch.Tensor]], None]) -> Path:
    from safetensors.torch import load_file, save_file

    out = tmp / name
    out.mkdir()
    config = json.loads((source / "adapter_config.json").read_text())
    tensors = load_file(str(source / "adapter_model.safetensors"))
    edit(config, tensors)
    (out / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


def test_bad_adapters_are_refused_naming_the_field(make_engine: Callable[..., LLMEngine],
                                                   tiny_adapters: dict[str, Path], tmp_path: Path) -> None:
    engine = make_engine(warmup=False, max_batch_total_tokens=256, max_loras=2, max_lora_rank=8)
    src = tiny_adapters["qv"]
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    q_b = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"

    def wrong_shape(c: dict[str, Any], t: dict[str, torch.Tensor]) -> None:
        t[q_b] = torch.zeros(63, 8)

    def wrong_in(c: dict[str, Any], t: dict[str, torch.Tensor]) -> None:
        t[q_a] = torch.zeros(8, 65)

    def embed(c: dict[str, Any], t: dict[str, torch.Tensor]) -> None:
        t["base_model.model.model.embed_tokens.lora_A.weight"] = torch.zeros(8, 320)

    def dora(c: dict[str, Any], t: dict[str, torch.Tensor]) -> None:
        c["use_dora"] = True

    def no_b(c: dict[str, Any], t: dict[str, torch.Tensor]) -> None:
        del t[q_b]

    cases = {
        "shape": (wrong_shape, q_b, "(63, 8)"),
        "in": (wrong_in, q_a, "(8, 65)"),
        "target": (embed, "embed_tokens.lora_A.weight", "embed_tokens"),
        "dora": (dora, "use_dora", "DoRA"),
        "pair": (no_b, q_b, "missing"),
    }
    for case, (edit, field, words) in cases.items():
        reply = _load(engine, case, _write_bad(tmp_path, src, case, edit))
        assert reply.status == "INVALID_ARGUMENT", case
        assert field in reply.message and words in reply.message, (case, reply.message)
    big = save_peft_adapter(_tiny(engine), tmp_path / "big", r=16)
    reply = _load(engine, "big", big)
    assert reply.status == "INVALID_ARGUMENT" and "--max-lora-rank 8" in reply.message and reply.field
    (tmp_path / "nojson").mkdir()
    (tmp_path / "nojson" / "adapter_config.json").write_text("{r: 8")
    reply = _load(engine, "nojson", tmp_path / "nojson")
    assert reply.status == "INVALID_ARGUMENT" and "adapter_config.json" in reply.message and "JSON" in reply.message
    reply = _load(engine, "nofiles", tmp_path / "missing-dir")
    assert reply.status == "INVALID_ARGUMENT" and reply.field == "path"
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    reply = _load(engine, "noweights", tmp_path / "noweights")
    assert reply.status == "INVALID_ARGUMENT" and "adapter_model.safetensors" in reply.message
    # The engine still serves, and a good adapter still loads after all that.
    assert _load(engine, "qv", src).status == "OK"
    assert _tokens(_run(engine, [_request("after", (5, 6, 7), "qv", 3)])["after"])
    assert _load(engine, "qv", src).status == "ALREADY_EXISTS"
    assert _load(engine, "third", src).status == "OK"
    assert _load(engine, "fourth", src).status == "RESOURCE_EXHAUSTED"


def _tiny(engine: LLMEngine) -> Path:
    return engine.worker.info.model_dir


def test_startup_adapter_errors_name_the_flag(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--lora-adapters x=.*adapter_config.json"):
        _engine(tiny_model_dir("llama"), {"x": tmp_path})
    with pytest.raises(ConfigError, match="more than --max-loras 1"):
        EngineConfig(lora_adapters=(("a", "/x"), ("b", "/y")), max_loras=1)
    with pytest.raises(ConfigError, match="given more than once"):
        EngineConfig(lora_adapters=(("a", "/x"), ("a", "/y")))


def test_unload_refused_while_in_use_then_allowed(make_engine: Callable[..., LLMEngine],
                                                  tiny_adapters: dict[str, Path]) -> None:
    engine = make_engine(warmup=False, max_batch_total_tokens=256, max_loras=1)
    assert _load(engine, "qv", tiny_adapters["qv"]).status == "OK"
    engine.add_request(_request("busy", (5, 6, 7), "qv", 4))
    engine.step()
    reply = engine.adapter_command(AdapterCommand(2, "qv"))
    assert reply is not None and reply.status == "FAILED_PRECONDITION" and "in use by 1" in reply.message
    while engine.has_unfinished():
        engine.step()
    reply = engine.adapter_command(AdapterCommand(3, "qv"))
    assert reply is not None and reply.status == "OK" and reply.adapters == ()
    reply = engine.adapter_command(AdapterCommand(4, "qv"))
    assert reply is not None and reply.status == "NOT_FOUND"
    with pytest.raises(RequestRejected):
        engine.add_request(_request("gone", (5, 6, 7), "qv"))
    # The freed slot takes another adapter, whose outputs are its own.
    assert _load(engine, "mlp", tiny_adapters["mlp"]).status == "OK"
    expected = greedy_tokens(merged_model(_tiny(engine), tiny_adapters["mlp"]), PROMPTS["mlp"], 5)
    assert _tokens(_run(engine, [_request("m", PROMPTS["mlp"], "mlp", 5)])["m"]) == expected


def test_prefix_cache_never_shares_blocks_across_adapters(make_engine: Callable[..., LLMEngine],
                                                          tiny_adapters: dict[str, Path]) -> None:
    engine = make_engine(warmup=False, max_batch_total_tokens=512, max_loras=2)
    assert _load(engine, "qv", tiny_adapters["qv"]).status == "OK"
    assert _load(engine, "all", tiny_adapters["all"]).status == "OK"
    prompt = tuple(range(10, 30))  # 5 full blocks of 4

    def cached(rid: str, adapter: str) -> tuple[int, list[int]]:
        outs = _run(engine, [_request(rid, prompt, adapter, 4)])[rid]
        return outs[0].num_cached_tokens, _tokens(outs)

    first_qv = cached("qv1", "qv")
    assert first_qv[0] == 0
    assert cached("base", "")[0] == 0  # the base model never reads qv's blocks
    assert cached("all", "all")[0] == 0
    again = cached("qv2", "qv")
    assert again[0] >= 16 and again[1] == first_qv[1]  # the same adapter does
    # Unloaded and loaded again under the same name (other files): a new key, no stale KV.
    assert engine.adapter_command(AdapterCommand(9, "qv")).status == "OK"  # type: ignore[union-attr]
    assert _load(engine, "qv", tiny_adapters["mlp"]).status == "OK"
    assert cached("qv3", "qv")[0] == 0


def test_quantized_base_layers_add_the_delta(tiny_model_dir: Callable[[str], Path],
                                            tiny_adapters: dict[str, Path]) -> None:
    from loom.layers.linear import LinearBase
    from loom.lora.layers import LoraBatch, lora_batch

    base = tiny_model_dir("llama")
    engine = LLMEngine(EngineConfig(model_id=str(base), block_size=4, warmup=False, quantize="nf4",
                                    max_batch_total_tokens=256, lora_adapters=(("all", str(tiny_adapters["all"])),)))
    qkv = engine.worker.model.get_submodule("model.layers.0.self_attn.qkv_proj")
    assert isinstance(qkv, LinearBase) and "NF4" in type(qkv.quant_method).__name__.upper()
    assert qkv.lora is not None
    x = torch.randn(5, 64)
    plain = qkv.quant_method.apply(qkv, x, qkv.bias)
    rows = torch.tensor([1, 3])
    with lora_batch(LoraBatch(torch.tensor([0, 1, 0, 1, 0], dtype=torch.int32), [(1, rows)])):
        adapted = qkv(x)
    # The base rows are the NF4 layer's output, bit for bit; the adapter rows add peft's delta.
    assert torch.equal(adapted[[0, 2, 4]], plain[[0, 2, 4]])
    from safetensors.torch import load_file

    t = load_file(str(tiny_adapters["all"] / "adapter_model.safetensors"))
    scaling = 8 / 4 ** 0.5  # rsLoRA: alpha / sqrt(r)
    deltas = [(x[rows] @ t[f"base_model.model.model.layers.0.self_attn.{p}_proj.lora_A.weight"].T)
              @ t[f"base_model.model.model.layers.0.self_attn.{p}_proj.lora_B.weight"].T * scaling for p in "qkv"]
    torch.testing.assert_close(adapted[rows] - plain[rows], torch.cat(deltas, dim=1), atol=1e-4, rtol=1e-4)
    # And through the engine: the adapter's request differs from the base one's, the base
    # request equals an NF4 engine without adapters.
    got = _run(engine, [_request("a", PROMPTS["all"], "all", 6), _request("b", PROMPTS["all"], "", 6)])
    plain_engine = LLMEngine(EngineConfig(model_id=str(base), block_size=4, warmup=False, quantize="nf4",
                                          max_batch_total_tokens=256))
    ref = _run(plain_engine, [_request("b", PROMPTS["all"], "", 6)])
    assert _tokens(got["b"]) == _tokens(ref["b"]) != _tokens(got["a"])


def test_bench_l1_adapters_load_on_the_model(make_engine: Callable[..., LLMEngine], tmp_path: Path) -> None:
    """loom bench L1's random adapters are valid PEFT directories for the model they are made for."""
    from loom.bench.lora import TARGETS, write_random_adapter

    engine = make_engine(warmup=False, max_batch_total_tokens=256, max_loras=1)
    path = write_random_adapter(_tiny(engine), tmp_path / "l1", rank=16, scale=0.2)
    reply = _load(engine, "l1", path)
    assert reply.status == "OK" and reply.adapter.rank == 16 and reply.adapter.target_modules == tuple(sorted(TARGETS))
    base = _tokens(_run(engine, [_request("base", PROMPTS[""], "", 6)])["base"])
    assert _tokens(_run(engine, [_request("l1", PROMPTS[""], "l1", 6)])["l1"]) != base


def test_speculative_verification_rows_use_the_adapter(tiny_model_dir: Callable[[str], Path],
                                                       tiny_adapters: dict[str, Path]) -> None:
    """Verification steps (a sequence's last token and its drafts as one segment of rows): the
    tokens stay those of peft's merged model, for an adapter and the base in one batch."""
    base = tiny_model_dir("llama")
    prompt = (5, 9, 33, 5, 9, 33, 5, 9, 33, 5, 9)  # repetitive: the n-gram proposer drafts
    expected = {n: greedy_tokens(merged_model(base, tiny_adapters.get(n)), prompt, 12) for n in ("qv", "")}
    engine = _engine(base, {"qv": tiny_adapters["qv"]}, speculate=3)
    got = _run(engine, [_request(f"s-{n}", prompt, n, 12) for n in ("qv", "")])
    assert {n: _tokens(got[f"s-{n}"]) for n in ("qv", "")} == expected
    assert sum(o.num_draft_tokens for outs in got.values() for o in outs) > 0  # drafts were verified


def test_kernel_variants_are_compiled_before_serving(tiny_model_dir: Callable[[str], Path]) -> None:
    """The device kernel is called once per distinct layer shape and warm-up size before serving
    (its prefill tile heights included), with zero deltas: slot 1, whose tables are still empty."""
    from loom.lora.layers import WARM_UP_TOKENS, LoraSlots
    from loom.model_loader import load_model
    from loom.plugin_api import default_registry

    loaded = load_model(tiny_model_dir("llama"), torch.float32, torch.device("cpu"), default_registry(), "auto")
    calls: list[tuple[int, int, int, tuple[int, ...]]] = []

    def kernel(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, out: torch.Tensor,
               order: torch.Tensor | None = None, parts: Any = None) -> None:
        assert bool((slots == 1).all()) and order is not None and bool((a == 0).all())
        calls.append((x.shape[0], x.shape[1], out.shape[1], tuple(parts)))

    lora = LoraSlots(loaded.model, 2, 8, torch.device("cpu"), torch.float32, kernel)
    lora.warm_up_kernel(4096)
    shapes = {(layer.a.shape[2], tuple(layer.part_sizes)) for layer in lora.layers.values()}
    sizes = sorted({min(n, 4096) for n in WARM_UP_TOKENS})
    assert sorted(calls) == sorted((t, k, sum(p), p) for k, p in shapes for t in sizes)
    assert len(shapes) < len(lora.layers)  # each shape once, not each layer
