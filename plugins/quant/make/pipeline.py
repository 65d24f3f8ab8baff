"""The model, layer by layer, over the calibration activations: what ``loom quantize`` runs.

The source model is loaded with transformers in float32 on the CPU (its module names are the
checkpoint's). For GPTQ and AWQ the calibration windows go through the embedding once; then each
decoder layer in turn sees the previous *quantized* layer's outputs, is quantized, and produces
the next layer's inputs. With ``--device cuda`` each decoder layer moves to the GPU for its turn
(its calibration forward, Hessians, Cholesky factors and the column loop run there) and back,
and only one layer, its activations and its Hessians are ever on the GPU: llama-8b's largest
layer is 0.9 GB in float32, its down_proj Hessian 1.6 GB in float64. RTN rounds each linear on
the device the same way. GPTQ quantizes a layer's linears in the order they compute (q/k/v, o,
gate/up, down), each group's Hessian taken after the groups before it were quantized
("true sequential"). The embedding stays dense; the head too, unless ``--lm-head`` (gptq and rtn)
quantizes it as GPTQModel's ``lm_head=True`` does: GPTQ then calibrates it last, on the final
norm's outputs of the quantized layers. A tied head gets tensors of its own (``lm_head.qweight``...)
and the written config unties it (``tie_word_embeddings: false``); the embedding keeps the dense
matrix.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .awq_search import search_scales
from .calibration import calibration_windows
from .gptq_solver import HessianAccumulator, gptq_quantize
from .group_quant import QuantizedLinear, rtn
from .writers import (
    awq_tensors,
    fp8_tensors,
    gptq_tensors,
    nf4_tensors,
    quantization_config,
    write_checkpoint,
)

METHODS = ("gptq", "awq", "rtn", "fp8", "nf4")
GPTQ_ORDER = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
AWQ_SEARCH_TOKENS = 2048  # calibration tokens the AWQ grid search evaluates on (evenly spaced)
HEAD = "lm_head"  # the head's checkpoint module (transformers' name in every architecture Loom serves)


class QuantizeError(ValueError):
    """A request ``loom quantize`` cannot carry out; the message names the flag or the layer."""


@dataclass(frozen=True)
class QuantizeRequest:
    method: str
    bits: int = 4
    group_size: int = 128
    act_order: bool = False
    samples: int = 8
    seq_len: int = 512
    damp: float = 0.01  # GPTQ: added to H's diagonal, as a share of its mean
    # GPTQ: how many times the first token of each calibration window counts in H. That token is
    # the attention sink every later token attends to, but only one in seq_len of the data: with
    # weight 1 GPTQ may move error into its direction (docs/quantization.md, Q1).
    sink_weight: float = 1.0
    device: str = "cpu"  # where each layer is quantized ("cpu", "cuda", "cuda:1"...)
    lm_head: bool = False  # gptq / rtn: the head too (GPTQ's quantization_config.lm_head)

    def check(self) -> None:
        if self.method not in METHODS:
            raise QuantizeError(f"--method {self.method!r}: expected one of {', '.join(METHODS)}")
        if self.method in ("gptq", "rtn") and self.bits not in (2, 4, 8):
            raise QuantizeError(f"--bits {self.bits}: GPTQ-format checkpoints take 2, 4 or 8 bits")
        if self.method == "awq" and self.bits != 4:
            raise QuantizeError(f"--bits {self.bits}: AWQ GEMM checkpoints are 4-bit")
        if self.method in ("gptq", "rtn", "awq") and (self.group_size == 0 or self.group_size < -1):
            raise QuantizeError(f"--group-size {self.group_size}: expected a positive number of inputs, or -1")
        if self.method == "awq" and self.group_size == -1:
            raise QuantizeError("--group-size -1: AWQ checkpoints quantize in groups (64, 128...)")
        if self.lm_head and self.method not in ("gptq", "rtn"):
            raise QuantizeError(f"--lm-head applies to --method gptq and rtn (GPTQ checkpoints say lm_head: true); "
                                f"{self.method} checkpoints keep the head dense")
        if self.act_order and self.method != "gptq":
            raise QuantizeError("--act-order applies to --method gptq only")
        if self.samples < 1 or self.seq_len < 16:
            raise QuantizeError("--samples must be at least 1 and --seq-len at least 16")
        if not 0 < self.damp <= 1:
            raise QuantizeError(f"--damp {self.damp}: expected a share of the Hessian's mean diagonal in (0, 1]")
        if self.sink_weight < 1:
            raise QuantizeError(f"--sink-weight {self.sink_weight}: expected at least 1 (1: every token counts once)")
        try:
            device = torch.device(self.device)
        except (RuntimeError, ValueError):
            raise QuantizeError(f"--device {self.device!r}: expected cpu or cuda (cuda:N)") from None
        if device.type not in ("cpu", "cuda"):
            raise QuantizeError(f"--device {self.device!r}: expected cpu or cuda (cuda:N)")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise QuantizeError(f"--device {self.device}: this machine has no CUDA device (torch {torch.__version__})")
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise QuantizeError(f"--device {self.device}: only {torch.cuda.device_count()} CUDA device(s) here")


# An MoE expert's projection as checkpoints name it: ``...experts.<N>.<gate_proj|w1|...>.weight``.
EXPERT_WEIGHT = re.compile(r"\.experts\.\d+\.[^.]+\.weight$")


def checkpoint_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The model's tensors under the names its checkpoints use. transformers 5 holds some modules
    differently in memory than on disk (MoE experts stacked into ``experts.gate_up_proj``,
    Mixtral's ``block_sparse_moe`` renamed ``mlp``) and ``save_pretrained`` converts them back;
    so does this, so Loom, vLLM and transformers read the written checkpoint (per-expert tensors,
    the names on the Hub)."""
    state = model.state_dict()
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers without conversions holds the checkpoint's names
        return state
    return dict(revert_weight_conversion(model, state))


def decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The quantized linears: every nn.Linear inside the decoder layers (the head stays dense)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in name}


def quantized_linears(model: Any, request: QuantizeRequest) -> dict[str, nn.Linear]:
    """What ``request`` quantizes: the decoder layers' linears, and with ``lm_head`` the head."""
    linears = decoder_linears(model)
    if request.lm_head:
        head = model.get_output_embeddings()
        if not isinstance(head, nn.Linear):
            raise QuantizeError(f"--lm-head: the model's head is a {type(head).__name__}, not a linear layer")
        linears[HEAD] = head
    return linears


def check_shapes(request: QuantizeRequest, linears: dict[str, nn.Linear]) -> None:
    if request.method not in ("gptq", "rtn", "awq"):
        return
    for name, linear in linears.items():
        gs = request.group_size
        if gs != -1 and linear.in_features % gs:
            fits = [g for g in (32, 64, 128) if linear.in_features % g == 0]
            raise QuantizeError(
                f"--group-size {gs} does not divide the input size {linear.in_features} of {name} (a ragged last "
                f"group is not supported: other GPTQ/AWQ readers refuse it); use --group-size "
                f"{' or '.join(map(str, fits)) or '-1'}")
        per_word = 32 // request.bits
        if linear.out_features % per_word or linear.in_features % per_word:
            raise QuantizeError(f"{name} is {linear.out_features} x {linear.in_features}: both must be multiples of "
                                f"{per_word} to pack {request.bits}-bit values into int32 words")


def load_source(model_dir: Path) -> Any:
    """The dense model in float32 on the CPU (random-weight models drawn with a fixed seed)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from loom.model_loader.random_model import random_weights_of

    config = AutoConfig.from_pretrained(str(model_dir))
    if random_weights_of(config) is not None:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.eval()


def source_dtype(model_dir: Path) -> torch.dtype:
    import json

    config = json.loads((model_dir / "config.json").read_text())
    name = config.get("torch_dtype") or config.get("dtype") or "float32"
    dtype = getattr(torch, str(name), torch.float32)
    return dtype if dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.float32


class _Stop(Exception):
    pass


def first_layer_inputs(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    """The hidden states and keyword arguments the first decoder layer is called with."""
    layers = model.model.layers
    captured: dict[str, Any] = {}

    def grab(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        captured["hidden"] = args[0] if args else kwargs.pop("hidden_states")
        captured["kwargs"] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        raise _Stop

    handle = layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        model(ids, use_cache=False)
    except _Stop:
        pass
    finally:
        handle.remove()
    return captured["hidden"], captured["kwargs"]


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it (nested in tuples, lists and dicts: a layer's keyword
    arguments, such as the rotary ``position_embeddings``) on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def run_layer(layer: nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def capture_inputs(layer: nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any],
                   modules: dict[str, nn.Module], sink: Callable[[str, torch.Tensor], None]) -> None:
    """Run ``layer`` once, handing each of ``modules``' input to ``sink(name, x)``."""
    handles = [m.register_forward_pre_hook(lambda _m, args, name=name: sink(name, args[0]))
               for name, m in modules.items()]
    try:
        run_layer(layer, hidden, kwargs)
    finally:
        for h in handles:
            h.remove()


def set_weight(linear: nn.Linear, ql: QuantizedLinear) -> None:
    linear.weight.data.copy_(ql.dequantize())


@torch.no_grad()
def gptq_layer(layer: nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any], request: QuantizeRequest,
               prefix: str, results: dict[str, QuantizedLinear]) -> None:
    for group in GPTQ_ORDER:
        modules = {n: m for n, m in layer.named_modules() if n.rpartition(".")[2] in group}
        # The group's linears read the same input, so they share one Hessian, and GPTQ treats
        # weight rows independently given it: quantizing their rows stacked is the same as one by
        # one, in a third of the column steps.
        first = next(iter(modules))
        acc = HessianAccumulator(modules[first].in_features)
        capture_inputs(layer, hidden, kwargs, {first: modules[first]}, _adder(acc, request.sink_weight))
        stacked = torch.cat([m.weight.data for m in modules.values()])
        ql = gptq_quantize(stacked, acc.hessian(), request.bits, request.group_size, sym=True,
                           act_order=request.act_order, damp=request.damp)
        start = 0
        for name, module in modules.items():
            rows = slice(start, start + module.out_features)
            part = QuantizedLinear(ql.codes[rows], ql.scales[rows], ql.zeros[rows], ql.g_idx, ql.bits)
            set_weight(module, part)
            results[f"{prefix}.{name}"] = part
            start += module.out_features


def _adder(acc: HessianAccumulator, sink_weight: float = 1.0) -> Callable[[str, torch.Tensor], None]:
    """Adds a linear's inputs ``x [windows, T, in]`` to ``acc``; the first token of each window
    ``sink_weight`` times in all."""
    extra = math.sqrt(sink_weight - 1.0)

    def add(_name: str, x: torch.Tensor) -> None:
        acc.add(x)
        if extra > 0:
            acc.add(x[:, :1] * extra)  # (w - 1) x0 x0^T more

    return add


def _sample_rows(x: torch.Tensor, limit: int) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1]).float()
    step = max(1, flat.shape[0] // limit)
    return flat[::step][:limit]


@torch.no_grad()
def awq_layer(layer: Any, hidden: torch.Tensor, kwargs: dict[str, Any], request: QuantizeRequest,
              prefix: str, results: dict[str, QuantizedLinear]) -> None:
    attn, mlp = layer.self_attn, layer.mlp
    inputs: dict[str, torch.Tensor] = {}
    watched = {"qkv": attn.q_proj, "o": attn.o_proj, "gate_up": mlp.gate_proj, "down": mlp.down_proj}
    capture_inputs(layer, hidden, kwargs, watched,
                   lambda name, x: inputs.__setitem__(name, _sample_rows(x, AWQ_SEARCH_TOKENS)))
    bits, gs = request.bits, request.group_size

    def scale_pair(previous: Any, after: list[nn.Linear], x: torch.Tensor, rows_of_previous: bool) -> None:
        s = search_scales(x, [m.weight.data for m in after], bits, gs)  # [in]
        if rows_of_previous:  # a linear before: its output rows shrink by s
            previous.weight.data.div_(s.view(-1, 1))
            if getattr(previous, "bias", None) is not None:
                previous.bias.data.div_(s)
        else:  # a norm before: its weight shrinks by s
            previous.weight.data.div_(s)
        for m in after:
            m.weight.data.mul_(s.view(1, -1))

    scale_pair(layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], inputs["qkv"], False)
    if attn.v_proj.out_features == attn.o_proj.in_features:  # not with grouped KV heads (v is narrower)
        scale_pair(attn.v_proj, [attn.o_proj], inputs["o"], True)
    scale_pair(layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], inputs["gate_up"], False)
    scale_pair(mlp.up_proj, [mlp.down_proj], inputs["down"], True)
    for name, module in layer.named_modules():
        if isinstance(module, nn.Linear):
            ql = rtn(module.weight.data, bits, gs, sym=False)
            set_weight(module, ql)
            results[f"{prefix}.{name}"] = ql


def _packed(method: str, stem: str, ql: QuantizedLinear) -> dict[str, torch.Tensor]:
    """A linear's checkpoint tensors (GPTQ v1 for gptq and rtn, AWQ GEMM), on the CPU."""
    made = awq_tensors(stem, ql) if method == "awq" else gptq_tensors(stem, ql)
    return {name: t.cpu() for name, t in made.items()}


@torch.no_grad()
def quantize_model(model_dir: Path, out_dir: Path, request: QuantizeRequest, progress: bool = True) -> Path:
    """Quantize the model in ``model_dir`` (a Hugging Face directory: what ``resolve_model_dir``
    gives) with ``request`` and write the checkpoint to ``out_dir``."""
    from tqdm.auto import tqdm

    request.check()
    device = torch.device(request.device)
    model = load_source(model_dir)
    linears = quantized_linears(model, request)
    check_shapes(request, linears)
    dtype = source_dtype(model_dir)
    # each quantized linear's checkpoint tensors, packed where it was quantized and then kept on
    # the CPU (llama-8b's codes as int64 would take 56 GB; packed they take 3.5)
    packed: dict[str, dict[str, torch.Tensor]] = {}
    if request.method in ("gptq", "awq"):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        ids = calibration_windows(tokenizer, request.samples, request.seq_len, int(model.config.vocab_size))
        hidden, kwargs = first_layer_inputs(model, ids)
        hidden, kwargs = hidden.to(device), to_device(kwargs, device)
        step = gptq_layer if request.method == "gptq" else awq_layer
        layers = model.model.layers
        for i in tqdm(range(len(layers)), desc=f"{request.method} ({ids.numel()} calibration tokens, {device})",
                      unit="layer", disable=not progress):
            layer = layers[i].to(device)
            found: dict[str, QuantizedLinear] = {}
            step(layer, hidden, kwargs, request, f"model.layers.{i}", found)
            hidden = run_layer(layer, hidden, kwargs)  # the quantized layer's outputs feed the next
            layers[i] = layer.to("cpu")
            packed.update({name: _packed(request.method, name, ql) for name, ql in found.items()})
        if request.lm_head:  # (gptq) last, on the final norm's outputs of the quantized layers
            packed[HEAD] = _packed("gptq", HEAD, gptq_head(model, hidden, request))
    elif request.method == "rtn":
        for name, linear in tqdm(linears.items(), desc=f"rtn ({device})", unit="linear", disable=not progress):
            packed[name] = _packed("rtn", name, rtn(linear.weight.data.to(device), request.bits, request.group_size,
                                                    sym=True, min_zero=1))
    tensors: dict[str, torch.Tensor] = {}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, tensor in checkpoint_state_dict(model).items():
        if tied and name == f"{HEAD}.weight" and not request.lm_head:
            continue  # (the embedding's matrix: written once, under its own name)
        stem = name.removesuffix(".weight")
        if request.method == "fp8" and EXPERT_WEIGHT.search(name) and tensor.dim() == 2:
            tensors.update(fp8_tensors(stem, tensor.to(dtype)))  # an MoE expert's projection: FP8 too
        elif stem not in linears or not name.endswith(".weight"):
            tensors[name] = tensor.to(dtype)
        elif request.method in ("gptq", "rtn", "awq"):
            tensors.update(packed[stem])
        elif request.method == "fp8":
            tensors.update(fp8_tensors(stem, tensor.to(dtype)))
        else:
            tensors.update(nf4_tensors(stem, tensor.to(dtype), dtype))
    qconfig = quantization_config(request.method, request.bits, request.group_size, request.act_order, dtype,
                                  request.lm_head)
    # a tied head quantized has tensors of its own: the config must not tie it to the embedding
    write_checkpoint(model_dir, out_dir, tensors, qconfig, dtype, untie=request.lm_head and tied)
    return out_dir


@torch.no_grad()
def gptq_head(model: Any, hidden: torch.Tensor, request: QuantizeRequest) -> QuantizedLinear:
    """GPTQ on the head, its Hessian from the final norm's outputs of the last (quantized) layer's
    ``hidden [windows, T, H]``. The head's own weight is not changed (tied, it is the embedding)."""
    device = hidden.device
    norm = model.model.norm.to(device)
    x = norm(hidden)
    model.model.norm = norm.to("cpu")
    head = model.get_output_embeddings()
    acc = HessianAccumulator(head.in_features)
    _adder(acc, request.sink_weight)(HEAD, x)
    return gptq_quantize(head.weight.data.to(device), acc.hessian(), request.bits, request.group_size, sym=True,
                         act_order=request.act_order, damp=request.damp)
