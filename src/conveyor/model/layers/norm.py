"""RMSNorm: the weight and epsilon of one norm; the math (float32, cast back, optionally fused
with the residual add before it) is the model's backend's (``model/backends/``)."""

from __future__ import annotations

import torch

from conveyor.model.backends.base import Backend


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float, backend: Backend) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x), or with ``residual``: residual += x (in place), then norm(residual).

        ``out`` is a buffer the result may be written into (x itself, when the caller no longer
        needs it: a long prefill then allocates one activation less)."""
        return self.backend.rms_norm(x, self.weight, self.eps, residual, out)
