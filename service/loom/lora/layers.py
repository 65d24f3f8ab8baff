"""LoRA on the device: each adaptable linear layer's slot table, the step's row -> slot map, and
the batched delta added to the base layer's output.

Every adaptable layer (q/k/v, o, gate/up, down) holds two stacked tables for ``S = max_loras +
1`` slots (slot 0 is the base model: zeros, never written) and ``R = max_lora_rank``:

- ``a``: [S, P * R, in]: the A factors of the layer's P fused parts (qkv: 3, gate/up: 2, others
  1), part p in rows ``p * R : p * R + r``;
- ``b``: [S, out, P * R]: the B factors, scaled, block-diagonal: the output rows of part p read
  only columns ``p * R : (p + 1) * R``.

so a fused layer is one LoRA of rank P * R whose output slices are each part's own adapter. The
tables have a fixed size, allocated once: loading an adapter copies into its slot, and a CUDA
graph captured over the tables stays valid. The delta is added to whatever the base layer's
quantization method computed (``out += (x @ a[s]^T) @ b[s]^T`` for the rows of slot s).

Each step the model runner sets a :class:`LoraBatch` (:func:`lora_batch`): the slot of every
row; on the CPU the rows of each adapter present (one gather, two GEMMs and a scatter-add per
adapter present and layer, no per-row loop); on CUDA a Triton kernel
(``plugins/lora/sgmv_triton.py``, handed in by the worker) reads the per-row slots from a fixed
device buffer, and the rows sorted by slot on the device once per step
(:meth:`LoraBatch.kernel_order`), so the step can be captured in a CUDA graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from .peft_adapter import _PREFIX, SUPPORTED_TARGETS, AdapterError, PeftAdapter


@dataclass(frozen=True)
class LayerTarget:
    """Where an adapter's projection lands: plain data, so adapters can be checked off the step loop."""

    layer: str  # the Loom layer's dotted name ("model.layers.0.self_attn.qkv_proj")
    part: int  # which fused part
    num_parts: int
    in_features: int
    out_offset: int  # the part's first output row in the fused layer
    out_features: int  # the part's rows
    layer_out_features: int  # all the fused layer's rows


class LoraKernel(Protocol):
    """A device kernel for the delta: (x [T, in], a [S, W, in], b [S, out, W], token_slots [T]
    int32, out [T, out]) -> None, adding each row's delta to ``out`` in place (rows of slot 0
    untouched). ``order``: the rows sorted by slot (:meth:`LoraBatch.kernel_order`), or None;
    ``parts``: the output sizes of the layer's fused parts (B block-diagonal over them), or None
    (one part)."""

    def __call__(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor,
                 out: torch.Tensor, order: torch.Tensor | None = None,
                 parts: Sequence[int] | None = None) -> None: ...


@dataclass
class LoraBatch:
    """One step's rows -> adapter slots (on the layers' device)."""

    token_slots: torch.Tensor  # [T] int32, 0 = base model
    rows_by_slot: list[tuple[int, torch.Tensor]]  # torch path: (slot, rows [n] int64) per adapter present
    use_kernel: bool = False  # the layers' device kernel over token_slots (CUDA), not the torch path
    order: torch.Tensor | None = None  # kernel: [T] int64, the rows sorted by slot (see kernel_order)

    def kernel_order(self) -> torch.Tensor:
        """The rows sorted by slot (stable), sorted on the device at the step's first adapted layer
        and kept for the others: once per step, no host read, so inside a captured CUDA graph when
        the step is captured. A kernel tile then holds one adapter's rows even where decode rows of
        several adapters interleave."""
        if self.order is None:
            self.order = torch.sort(self.token_slots, stable=True).indices
        return self.order


_batch: LoraBatch | None = None


@contextlib.contextmanager
def lora_batch(batch: LoraBatch | None) -> Iterator[None]:
    """Set the step's row -> slot map for the duration of one model forward."""
    global _batch
    previous, _batch = _batch, batch
    try:
        yield
    finally:
        _batch = previous


class LoraLayerWeights(nn.Module):
    """One layer's slot tables (see the module docstring) and the delta it adds."""

    def __init__(self, num_slots: int, max_rank: int, in_features: int, part_sizes: list[int],
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.max_rank = max_rank
        self.part_sizes = part_sizes
        self.part_offsets = [sum(part_sizes[:i]) for i in range(len(part_sizes))]
        width = len(part_sizes) * max_rank
        self.kernel: LoraKernel | None = None  # set by LoraSlots where a device kernel serves
        self.register_buffer("a", torch.zeros(num_slots, width, in_features, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("b", torch.zeros(num_slots, sum(part_sizes), width, dtype=dtype, device=device),
                             persistent=False)

    a: torch.Tensor
    b: torch.Tensor

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` [T, out] plus each row's adapter delta for ``x`` [T, in] (in place)."""
        batch = _batch
        if batch is None:
            return out
        if batch.use_kernel and self.kernel is not None:
            self.kernel(x, self.a, self.b, batch.token_slots, out, order=batch.kernel_order(), parts=self.part_sizes)
            return out
        for slot, rows in batch.rows_by_slot:
            xs = x.index_select(0, rows)  # [n, in]
            delta = (xs @ self.a[slot].t()) @ self.b[slot].t()  # [n, P*R] -> [n, out]
            out.index_add_(0, rows, delta.to(out.dtype))
        return out

    def write(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a[slot].copy_(a)
        self.b[slot].copy_(b)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()


class LoraSlots:
    """The model's adaptable layers with their slot tables, made once when the worker loads the
    model with ``--max-loras`` above 0."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, device: torch.device,
                 dtype: torch.dtype, kernel: LoraKernel | None = None) -> None:
        from loom.layers.linear import LinearBase

        self.max_loras, self.max_rank, self.kernel = max_loras, max_rank, kernel
        packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
        self.layers: dict[str, LoraLayerWeights] = {}
        self.targets: dict[str, LayerTarget] = {}  # Hugging Face module name -> where it lands
        for name, module in model.named_modules():
            if not isinstance(module, LinearBase):
                continue
            parent, _, leaf = name.rpartition(".")
            parts = packed.get(leaf, [leaf])
            if not all(p in SUPPORTED_TARGETS for p in parts):
                continue
            if module.tp_size != 1:
                raise ValueError("LoRA adapters are not served with tensor parallelism yet")
            sizes = list(module.output_partition_sizes)
            if len(sizes) != len(parts):
                continue  # a checkpoint-fused layer (Phi-3's qkv_proj) whose parts Loom does not name
            weights = LoraLayerWeights(max_loras + 1, max_rank, module.input_size_per_partition, sizes, dtype, device)
            weights.kernel = kernel
            object.__setattr__(module, "lora", weights)  # not a submodule: no state_dict entries
            self.layers[name] = weights
            for i, p in enumerate(parts):
                hf_name = f"{parent}.{p}" if parent else p
                self.targets[hf_name] = LayerTarget(name, i, len(parts), module.input_size_per_partition,
                                                    sum(sizes[:i]), sizes[i], sum(sizes))

    def install(self, slot: int, tables: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write an adapter's tables (:func:`adapter_tables`) into ``slot``; layers it does not
        adapt are zeroed."""
        assert 1 <= slot <= self.max_loras, slot
        for name, layer in self.layers.items():
            if name in tables:
                a, b = tables[name]
                layer.write(slot, a, b)
            else:
                layer.clear(slot)

    def clear(self, slot: int) -> None:
        for layer in self.layers.values():
            layer.clear(slot)

    def warm_up_kernel(self, max_tokens: int) -> None:
        """Compile the device kernel's variants before serving: each distinct layer shape at step
        sizes that pick each of the kernel's tile heights (``WARM_UP_TOKENS``, up to
        ``max_tokens``). The engine's warm-up runs the base model only, so without this every
        variant compiled at the first steps with adapters (on the H200, L1's first prefills
        waited seconds for them). The rows use slot 1, whose tables hold no adapter yet: the
        delta is zero."""
        if self.kernel is None or not self.layers or self.max_loras < 1:
            return
        seen: set[tuple[int, tuple[int, ...]]] = set()
        for layer in self.layers.values():
            key = (layer.a.shape[2], tuple(layer.part_sizes))
            if key in seen:
                continue
            seen.add(key)
            for t in sorted({min(n, max_tokens) for n in WARM_UP_TOKENS}):
                x = torch.zeros(t, layer.a.shape[2], dtype=layer.a.dtype, device=layer.a.device)
                out = torch.zeros(t, layer.b.shape[1], dtype=layer.a.dtype, device=layer.a.device)
                slots = torch.ones(t, dtype=torch.int32, device=layer.a.device)
                batch = LoraBatch(slots, [], use_kernel=True)
                self.kernel(x, layer.a, layer.b, slots, out, order=batch.kernel_order(), parts=layer.part_sizes)


# Step sizes whose kernel launches cover the kernel's tile heights (plugins/lora/sgmv_triton.py:
# 16-row tiles up to 2,048 rows, 32 up to 4,096, 64 beyond) and its split and unsplit K.
WARM_UP_TOKENS = (1, 256, 2048, 4096, 8192)


def adapter_tables(adapter: PeftAdapter, targets: dict[str, LayerTarget], max_rank: int,
                   dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """An adapter's factors laid out as slot-table entries per Loom layer (CPU, ``dtype``), scaling
    folded into B; raises :class:`AdapterError` naming the tensor that does not fit the model."""
    tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, lora in adapter.modules.items():
        target = targets.get(module)
        if target is None:
            raise AdapterError(f"{_PREFIX}{module}.lora_A.weight",
                               f"the base model has no adaptable layer {module!r}")
        r, in_features = lora.a.shape
        if in_features != target.in_features:
            raise AdapterError(f"{_PREFIX}{module}.lora_A.weight",
                               f"has shape {tuple(lora.a.shape)}, expected ({r}, {target.in_features}) for this model")
        if lora.b.shape[0] != target.out_features:
            raise AdapterError(f"{_PREFIX}{module}.lora_B.weight",
                               f"has shape {tuple(lora.b.shape)}, expected ({target.out_features}, {r}) for this model")
        width = target.num_parts * max_rank
        if target.layer not in tables:
            tables[target.layer] = (torch.zeros(width, target.in_features, dtype=torch.float32),
                                    torch.zeros(target.layer_out_features, width, dtype=torch.float32))
        a, b = tables[target.layer]
        col, row = target.part * max_rank, target.out_offset
        a[col : col + r] = lora.a
        b[row : row + target.out_features, col : col + r] = lora.b * lora.scaling
    return {name: (a.to(dtype), b.to(dtype)) for name, (a, b) in tables.items()}
