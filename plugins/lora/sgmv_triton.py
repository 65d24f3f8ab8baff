"""The LoRA delta on CUDA in two Triton kernels over fixed-size slot tables (BGMV-style: each
row gathers its own adapter's factors by its slot, so one launch serves every adapter of the
step and rows of the base model, slot 0, do nothing).

    shrink: h[t, :]   = x[t, :] @ a[slot[t]]^T      x [T, in], a [S, W, in]  -> h [T, W] fp32
    expand: out[t, :] += h[t, :] @ b[slot[t]]^T     b [S, out, W]            -> out [T, out]

``W`` is the layer's parts times ``--max-lora-rank`` (``loom.lora.layers``). Nothing depends on
host data: the slots are read on the device, the grid depends only on T and the table shapes,
so a step can be captured in a CUDA graph and replayed with other adapters in other slots.

Each program handles one row and one block of outputs (a GEMV per row, as vLLM's and Punica's
BGMV kernels do for decode). Prefill rows of one sequence re-read the same factors: fine for
decode-heavy batches; a segmented GEMM over a sequence's rows (SGMV, ``tl.dot``) is the next
step for long prompts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Triton kernels take untyped pointers and sizes (their types are Triton's, at compile time).
# mypy: disable-error-code="no-untyped-def"


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, h_ptr, K, W,
                   stride_xt, stride_xk, stride_as, stride_aw, stride_ak, stride_ht,
                   BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    wb = tl.program_id(1)
    slot = tl.load(slots_ptr + t)
    if slot == 0:
        return
    offs_w = wb * BLOCK_W + tl.arange(0, BLOCK_W)
    acc = tl.zeros((BLOCK_W,), dtype=tl.float32)
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_ptr + t * stride_xt + offs_k * stride_xk, mask=offs_k < K, other=0.0).to(tl.float32)
        a = tl.load(a_base + offs_w[:, None] * stride_aw + offs_k[None, :] * stride_ak,
                    mask=(offs_w[:, None] < W) & (offs_k[None, :] < K), other=0.0).to(tl.float32)
        acc += tl.sum(a * xk[None, :], axis=1)
    tl.store(h_ptr + t * stride_ht + offs_w, acc, mask=offs_w < W)


@triton.jit
def _expand_kernel(h_ptr, b_ptr, slots_ptr, out_ptr, N, W,
                   stride_ht, stride_bs, stride_bn, stride_bw, stride_ot, stride_on,
                   BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    t = tl.program_id(0)
    nb = tl.program_id(1)
    slot = tl.load(slots_ptr + t)
    if slot == 0:
        return
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    b_base = b_ptr + slot.to(tl.int64) * stride_bs
    for w0 in range(0, W, BLOCK_W):
        offs_w = w0 + tl.arange(0, BLOCK_W)
        hw = tl.load(h_ptr + t * stride_ht + offs_w, mask=offs_w < W, other=0.0)
        b = tl.load(b_base + offs_n[:, None] * stride_bn + offs_w[None, :] * stride_bw,
                    mask=(offs_n[:, None] < N) & (offs_w[None, :] < W), other=0.0).to(tl.float32)
        acc += tl.sum(b * hw[None, :], axis=1)
    ptrs = out_ptr + t * stride_ot + offs_n * stride_on
    prev = tl.load(ptrs, mask=offs_n < N, other=0.0)
    tl.store(ptrs, (prev.to(tl.float32) + acc).to(prev.dtype), mask=offs_n < N)


def lora_shrink_expand(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor,
                       out: torch.Tensor) -> None:
    """``out[t] += (x[t] @ a[s]^T) @ b[s]^T`` for every row t with slot ``s = token_slots[t] > 0``
    (in place). x [T, in], a [S, W, in], b [S, out, W], token_slots [T] int32, out [T, out]."""
    T, K = x.shape
    W, N = a.shape[1], b.shape[1]
    if T == 0:
        return
    h = torch.empty(T, W, dtype=torch.float32, device=x.device)  # rows of slot 0 are never read
    block_w = triton.next_power_of_2(min(W, 64))
    _shrink_kernel[(T, triton.cdiv(W, block_w))](
        x, a, token_slots, h, K, W, x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), h.stride(0),
        BLOCK_W=block_w, BLOCK_K=64)
    block_n = 64
    _expand_kernel[(T, triton.cdiv(N, block_n))](
        h, b, token_slots, out, N, W, h.stride(0), b.stride(0), b.stride(1), b.stride(2), out.stride(0),
        out.stride(1), BLOCK_N=block_n, BLOCK_W=block_w)
