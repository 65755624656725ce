"""The CUDA path's row-wise element kernels: rotary embedding (transformers' rotate-half layout)
over every head of a token, and SiLU-and-multiply of a fused [gate | up] row. Float32 math,
one rounding to the tensor's dtype at the end."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh, stride_ct,
                   stride_ot, stride_oh, NUM_HEADS: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < NUM_HEADS) & (d[None, :] < HALF)
    x_row = x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :]
    x1 = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF, mask=mask, other=0.0).to(tl.float32)
    # cos and sin repeat their first half (cat(freqs, freqs)), so one half serves both
    cos = tl.load(cos_ptr + t * stride_ct + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + t * stride_ct + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    o_row = out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :]
    dtype = out_ptr.dtype.element_ty
    tl.store(o_row, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(o_row + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, heads, head_dim] (head_dim contiguous); cos, sin: [T, 1, head_dim] from
    ``RotaryEmbedding.cos_sin``. Written into ``out`` when given (x itself: in place)."""
    num_tokens, heads, head_dim = x.shape
    if x.stride(2) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError("head_dim must be contiguous in x, cos and sin")
    if out is None:
        out = torch.empty_like(x)
    if num_tokens:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](
            x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), out.stride(0),
            out.stride(1), NUM_HEADS=heads, HALF=half, BLOCK_H=triton.next_power_of_2(heads),
            BLOCK_D=triton.next_power_of_2(half))
    return out


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_g, stride_o, N: tl.constexpr,
                     BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(gate_up_ptr + t * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + t * stride_g + N + cols, mask=mask, other=0.0).to(tl.float32)
    silu = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + t * stride_o + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """[T, 2N] -> silu(gate) * up, [T, N]."""
    num_tokens, width = gate_up.shape
    if gate_up.stride(1) != 1:
        raise ValueError("rows must be contiguous")
    n = width // 2
    out = torch.empty((num_tokens, n), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens:
        block = min(block, triton.next_power_of_2(n))
        _silu_mul_kernel[(num_tokens, triton.cdiv(n, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), N=n, BLOCK=block)
    return out
