"""RMSNorm fused with the residual add before it, one program per row: ``residual += x`` (in
place, rounded to its dtype as torch's add is), then ``weight * norm(residual)`` with the norm in
float32 and rounded to the dtype before the weight multiplies, as transformers' LlamaRMSNorm
(and ``layers/norm.py``'s torch ops) do."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, stride_o,
                     eps, N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + r).to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_r + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    normed = normed.to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty),
             mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, N] (rows may be strided); with ``residual`` ([T, N]) it is updated in place and
    normed. Returns the norm, in ``out`` when it is a [T, N] tensor of x's dtype."""
    rows, n = x.shape
    if x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("rows must be contiguous")
    if out is None or out.shape != x.shape or out.dtype != x.dtype or out.stride(1) != 1:
        out = torch.empty_like(x)
    if rows:
        res = residual if residual is not None else x
        _rms_norm_kernel[(rows,)](x, res, weight, out, x.stride(0), res.stride(0), out.stride(0),
                                  eps, N=n, BLOCK=triton.next_power_of_2(n),
                                  HAS_RESIDUAL=residual is not None)
    return out
