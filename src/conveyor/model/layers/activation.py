"""SiLU-and-multiply, the gated MLP's activation: ``silu(gate) * up`` of a fused [gate | up] row.

On the CPU one pass in ``kernels/fused_ops.cpp``, on CUDA in ``kernels/triton/elementwise.py``;
elsewhere two torch ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.model.kernels import fused_ops
from conveyor.model.kernels.triton.common import triton_available


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.is_cuda and triton_available():
        from conveyor.model.kernels.triton.elementwise import silu_mul

        return silu_mul(gate_up)
    out = fused_ops.silu_mul(gate_up)
    if out is not None:
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
