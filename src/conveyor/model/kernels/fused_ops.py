"""The decoder layer's fused elementwise steps on the CPU (``torch.ops.conveyor.*``,
``fused_ops.cpp``).

Each function returns None when the kernel cannot serve the call (not CPU, not float32/bf16,
a width that is not a multiple of 16, a layout it does not take, kernels off or not
buildable): the caller (``backends/cpu_kernels.py``, ``sampler.py``) then runs the same math
in torch.
"""

from __future__ import annotations

import torch

from conveyor.model.kernels.build import kernel_ops

_DTYPES = (torch.float32, torch.bfloat16)


def _ops(x: torch.Tensor, width: int):
    if x.device.type != "cpu" or x.dtype not in _DTYPES or width % 16:
        return None
    return kernel_ops()


def _rows(x: torch.Tensor) -> bool:
    """2-D with unit-stride rows (a row stride is passed on)."""
    return x.dim() == 2 and x.stride(1) == 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [T, D]; with ``residual`` (contiguous [T, D], updated in place): norm of residual + x.
    Written into ``out`` when it is a contiguous tensor of x's shape and dtype (it may be x:
    each row is read before it is written)."""
    ops = _ops(x, x.shape[-1])
    if ops is None or not _rows(x) or weight.dtype != x.dtype:
        return None
    if residual is not None and (not residual.is_contiguous() or residual.dtype != x.dtype):
        return None
    if out is None or not out.is_contiguous() or out.shape != x.shape or out.dtype != x.dtype:
        out = torch.empty(x.shape, dtype=x.dtype)
    ops.rms_norm(x, weight, eps, residual, out)
    return out


def _gated(gate_up: torch.Tensor):
    ops = _ops(gate_up, gate_up.shape[-1] // 2)
    if ops is None or gate_up.dim() != 2 or not gate_up.is_contiguous():
        return None
    return ops


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """gate_up [T, 2 I] (gate first) -> silu(gate) * up [T, I]."""
    ops = _gated(gate_up)
    return None if ops is None else ops.silu_mul(gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """gate_up [T, 2 I] (gate first) -> gelu(gate, approximate="tanh") * up [T, I] (Gemma's
    MLP)."""
    ops = _gated(gate_up)
    return None if ops is None else ops.gelu_tanh_mul(gate_up)


def packed_heads(x: torch.Tensor) -> bool:
    """[T, H, D] whose heads are packed in each row (rows may be strided)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           out: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [T, H, D] (rows may be strided, heads packed); cos, sin [T, 1, D] -> [T, H, D], written
    into ``out`` when it has x's shape, dtype and layout rules (it may be x itself)."""
    t, heads, head_dim = x.shape
    ops = _ops(x, head_dim // 2)
    if (ops is None or not packed_heads(x) or not cos.is_contiguous()
            or not sin.is_contiguous() or cos.dtype != x.dtype or sin.dtype != x.dtype):
        return None
    if out is None or out.shape != x.shape or out.dtype != x.dtype or not packed_heads(out):
        out = torch.empty(t, heads, head_dim, dtype=x.dtype)
    ops.rotary(x, cos, sin, out)
    return out


def argmax(x: torch.Tensor) -> torch.Tensor | None:
    """x [R, V] -> [R] int64: each row's first index of its largest value (a NaN counts as the
    largest), as ``x.max(dim=-1).indices``; one pass over the row instead of torch's
    reduction."""
    ops = _ops(x, x.shape[-1])
    if ops is None or x.dim() != 2 or not x.is_contiguous() or x.numel() == 0:
        return None
    return ops.argmax(x)
