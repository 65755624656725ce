"""LoRA updates for a step's rows, each under its own adapter slot (``layers/lora.py``)."""

from __future__ import annotations

import torch


def lora_apply_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                slots: torch.Tensor, width: int) -> torch.Tensor:
    """``y[t] += (a[slots[t], :width] @ x[t]) @ b[slots[t], :width]`` for every row ``t`` whose
    slot is not 0, in float32, added in ``y``'s dtype; returns ``y``."""
    for slot in slots.unique().tolist():
        if slot == 0:
            continue
        rows = (slots == slot).nonzero().squeeze(1)
        t = x[rows].float() @ a[slot, :width].t()
        y.index_add_(0, rows, (t @ b[slot, :width]).to(y.dtype))
    return y
