"""LoRA adapters' updates added to a projection's output, each row (token) under its own adapter:
``torch.ops.conveyor.lora_apply`` (``lora.cpp``) on the CPU, ``kernels/triton/lora.py`` on CUDA,
plain torch elsewhere (and as the tests' reference).

The stacks hold every adapter a projection serves, one slot each: ``a`` [S, R, in] (row r: the
r-th row of the adapter's A) and ``b`` [S, R, out] (row r: the r-th column of its B, the scale
folded in), float32, slot 0 all zeros. ``slots`` [T] int32 gives each row's slot (0: the base
model, left untouched) and ``width`` how many of the R rows are in use.
"""

from __future__ import annotations

import torch

from conveyor.model.kernels.build import kernel_ops
from conveyor.model.kernels.triton.common import triton_available

_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def lora_apply_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                slots: torch.Tensor, width: int) -> torch.Tensor:
    """``y[t] += (a[s, :width] @ x[t]) @ b[s, :width]`` for every row t whose slot
    ``s = slots[t]`` is not 0, in float32, y rounded to its dtype once; returns y (updated in
    place). x [T, in] and y [T, out] share a dtype (float32, bf16 or fp16)."""
    if width == 0 or y.shape[0] == 0:
        return y
    if y.is_cuda and triton_available():
        from conveyor.model.kernels.triton.lora import lora_apply_ as triton_lora_apply_

        return triton_lora_apply_(y, x, a, b, slots, width)
    if (y.device.type == "cpu" and y.dtype in _CPU_DTYPES and y.is_contiguous()
            and x.shape[-1] % 16 == 0 and y.shape[-1] % 16 == 0):
        ops = kernel_ops()
        if ops is not None:
            ops.lora_apply(y, x, a, b, slots, width)
            return y
    return torch_lora_apply_(y, x, a, b, slots, width)


def torch_lora_apply_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      slots: torch.Tensor, width: int) -> torch.Tensor:
    """``lora_apply_`` in torch ops: two float32 matmuls per slot in the call."""
    for slot in slots.unique().tolist():
        if slot == 0:
            continue
        rows = (slots == slot).nonzero().squeeze(1)
        update = (x[rows].float() @ a[slot, :width].T) @ b[slot, :width]
        y[rows] = (y[rows].float() + update).to(y.dtype)
    return y
