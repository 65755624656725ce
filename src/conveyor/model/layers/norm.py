"""RMSNorm computed in float32 and cast back, like transformers' LlamaRMSNorm, optionally
fused with the residual add before it (``residual += x`` in place, then the norm of the sum).

On the CPU both are one pass in ``kernels/fused_ops.cpp``, on CUDA in
``kernels/triton/rms_norm.py``; elsewhere the torch ops below.
"""

from __future__ import annotations

import torch

from conveyor.model.kernels import fused_ops
from conveyor.model.kernels.triton.common import triton_available


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x), or with ``residual``: residual += x (in place), then norm(residual).

        ``out`` is a buffer the fused kernel may write the result into (x itself, when the
        caller no longer needs it: a long prefill then allocates one activation less)."""
        if x.dim() == 2 and x.is_cuda and triton_available():
            from conveyor.model.kernels.triton.rms_norm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual, out)
        if x.dim() == 2:
            fused = fused_ops.rms_norm(x, self.weight, self.eps, residual, out)
            if fused is not None:
                return fused
        if residual is not None:
            x = residual.add_(x)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
