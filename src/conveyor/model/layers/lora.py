"""LoRA on the model's projections: each adapter's low-rank update added to a projection's
output for the rows (tokens) of the step that run under it.

``LoRAContext`` is shared by every projection of a model: the executor sets, per step, which
rows run under which adapter (``set_rows``). ``LoRALayer`` holds, per adapter, the A and B of
the modules fused into one projection (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``),
each with the slice of the output it updates, its scale folded into B. A step's rows are grouped
by adapter, so one forward serves rows of several adapters and base rows together.
"""

from __future__ import annotations

import torch


class LoRAContext:
    def __init__(self) -> None:
        # (adapter id, the flat rows of this step that run under it), base rows left out
        self.groups: list[tuple[int, torch.Tensor]] = []

    def set_rows(self, groups: list[tuple[int, torch.Tensor]]) -> None:
        self.groups = groups


class LoRALayer:
    def __init__(self, context: LoRAContext, slices: dict[str, tuple[int, int]]) -> None:
        """``slices``: each module fused into the projection -> its output columns."""
        self.context = context
        self.slices = slices
        # adapter id -> [(first column, last column + 1, A [r, in], B [cols, r] * scale)]
        self.adapters: dict[int, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}

    def add(self, adapter_id: int, module: str, a: torch.Tensor, b: torch.Tensor,
            dtype: torch.dtype) -> None:
        start, end = self.slices[module]
        self.adapters.setdefault(adapter_id, []).append(
            (start, end, a.to(dtype).contiguous(), b.to(dtype).contiguous()))

    def remove(self, adapter_id: int) -> None:
        self.adapters.pop(adapter_id, None)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the projection of ``x``) with the step's adapters' updates added in place."""
        for adapter_id, rows in self.context.groups:
            parts = self.adapters.get(adapter_id)
            if not parts:
                continue
            xr = x[rows]
            for start, end, a, b in parts:
                y[rows, start:end] += (xr @ a.t()) @ b.t()
        return y
