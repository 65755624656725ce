"""LoRA adapters' updates on the CUDA path, each row (token) under its own adapter slot: Punica's
"BGMV" shape in two kernels, ``kernels/lora_ops.py``'s stacks and slots.

shrink, one program per row: ``u[t] = a[s] @ x[t]`` over the first ``width`` rows of the stack
(``s = slots[t]``), float32, into a [T, width] buffer; expand, one program per row and tile of
output columns: ``y[t, tile] += u[t] @ b[s, :width, tile]``, added to y in float32 and rounded to
its dtype once. Rows of slot 0 (the base model) are skipped by both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 128  # the shrink's step along the input
BLOCK_N = 128  # the expand's output columns per program


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, slot_ptr, u_ptr, stride_x, stride_as, stride_ar,
                        width, IN: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot != 0:
        r = tl.arange(0, BLOCK_R)
        k = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        a_rows = a_ptr + slot * stride_as + r[:, None] * stride_ar
        for k0 in range(0, IN, BLOCK_K):
            cols = k0 + k
            x = tl.load(x_ptr + t * stride_x + cols, mask=cols < IN, other=0.0).to(tl.float32)
            a = tl.load(a_rows + cols[None, :], mask=(r[:, None] < width) & (cols[None, :] < IN),
                        other=0.0)
            acc += tl.sum(a * x[None, :], axis=1)
        tl.store(u_ptr + t * width + r, acc, mask=r < width)


@triton.jit
def _lora_expand_kernel(y_ptr, b_ptr, slot_ptr, u_ptr, stride_y, stride_bs, stride_br, width,
                        OUT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot != 0:
        r = tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        u = tl.load(u_ptr + t * width + r, mask=r < width, other=0.0)
        b = tl.load(b_ptr + slot * stride_bs + r[:, None] * stride_br + cols[None, :],
                    mask=(r[:, None] < width) & (cols[None, :] < OUT), other=0.0)
        update = tl.sum(u[:, None] * b, axis=0)
        y_row = y_ptr + t * stride_y + cols
        y = tl.load(y_row, mask=cols < OUT, other=0.0).to(tl.float32)
        tl.store(y_row, (y + update).to(y_ptr.dtype.element_ty), mask=cols < OUT)


def block_r(width: int) -> int:
    """The kernels' tile of the stacks' rows: ``width`` to a power of two, at least 16."""
    return max(16, triton.next_power_of_2(width))


def lora_apply_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                slots: torch.Tensor, width: int) -> torch.Tensor:
    """``kernels/lora_ops.lora_apply_`` on CUDA tensors (or CPU ones in Triton's interpreter):
    x [T, in] and y [T, out] with unit-stride rows, a [S, R, in] and b [S, R, out] float32 with
    unit-stride rows, slots [T] int32."""
    rows, n_in = x.shape
    n_out = y.shape[1]
    if y.shape[0] != rows or slots.shape != (rows,):
        raise ValueError(f"x {tuple(x.shape)}, y {tuple(y.shape)} and slots "
                         f"{tuple(slots.shape)} must have one row per token")
    if a.shape[2] != n_in or b.shape[2] != n_out or a.shape[:2] != b.shape[:2]:
        raise ValueError(f"a {tuple(a.shape)} and b {tuple(b.shape)} must be [slots, R, "
                         f"{n_in}] and [slots, R, {n_out}]")
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        raise ValueError(f"a and b must be float32, got {a.dtype} and {b.dtype}")
    if not 0 <= width <= a.shape[1]:
        raise ValueError(f"width must be in 0..{a.shape[1]}, got {width}")
    if x.stride(1) != 1 or y.stride(1) != 1 or a.stride(2) != 1 or b.stride(2) != 1:
        raise ValueError("rows must be contiguous")
    if rows == 0 or width == 0:
        return y
    u = torch.empty(rows, width, dtype=torch.float32, device=y.device)
    tile = block_r(width)
    _lora_shrink_kernel[(rows,)](x, a, slots, u, x.stride(0), a.stride(0), a.stride(1), width,
                                 IN=n_in, BLOCK_R=tile, BLOCK_K=BLOCK_K)
    _lora_expand_kernel[(rows, triton.cdiv(n_out, BLOCK_N))](
        y, b, slots, u, y.stride(0), b.stride(0), b.stride(1), width, OUT=n_out, BLOCK_R=tile,
        BLOCK_N=BLOCK_N)
    return y
