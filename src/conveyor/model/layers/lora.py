"""LoRA on the model's projections: each adapter's low-rank update added to a projection's
output for the rows (tokens) of the step that run under it.

The model holds ``max_loras`` adapters at once, each in a numbered slot (1..max_loras; which
adapter sits where is the executor's business). ``LoRAContext`` is shared by every projection:
per step the executor sets the slot of each flat row (0: the base model). ``LoRALayer`` holds,
per projection, fixed stacks allocated once and written in place: A as [slots, R, in] and B as
[slots, R, out], float32, slot 0 all zeros. The modules fused into one projection (q/k/v into
``qkv_proj``, gate/up into ``gate_up_proj``) take their own rows of R and their own output
columns of B (B is block-diagonal over them), and the scale is folded into B. A step adds, for
each row, ``(A[slot] @ x) @ B[slot]`` over the first ``width`` rows of R (the widest adapter
held), with ``kernels/lora_ops.py``.
"""

from __future__ import annotations

import torch

from conveyor.model.kernels.lora_ops import lora_apply_


class LoRAContext:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots  # adapters held at once (slot 0, the base, not counted)
        self.slots: torch.Tensor | None = None  # [T] int32 this step; None: no adapter rows

    @property
    def active(self) -> bool:
        return self.slots is not None

    def set_slots(self, slots: list[int], device: torch.device) -> None:
        """This step's slot per flat row (0: base model)."""
        self.slots = (torch.tensor(slots, dtype=torch.int32, device=device)
                      if any(slots) else None)


class LoRALayer:
    def __init__(self, context: LoRAContext, slices: dict[str, tuple[int, int]],
                 in_features: int, max_rank: int, device: torch.device) -> None:
        """``slices``: each module fused into the projection -> its output columns."""
        self.context = context
        self.slices = slices
        out_features = max(end for _, end in slices.values())
        rows = max_rank * len(slices)
        self.a = torch.zeros(context.num_slots + 1, rows, in_features, device=device)
        self.b = torch.zeros(context.num_slots + 1, rows, out_features, device=device)
        self.widths = [0] * (context.num_slots + 1)  # rows of R each slot uses
        self.width = 0  # the widest slot's: what a step computes

    def set_slot(self, slot: int,
                 parts: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Hold in ``slot`` an adapter's update of this projection: per module its A [r, in]
        and B [cols, r] * scale (none: the adapter leaves this projection alone)."""
        if not 1 <= slot <= self.context.num_slots:
            raise ValueError(f"LoRA slot must be in [1, {self.context.num_slots}], got {slot}")
        self.a[slot].zero_()
        self.b[slot].zero_()
        row = 0
        for module, (a, b) in parts.items():
            start, end = self.slices[module]
            r = a.shape[0]
            self.a[slot, row:row + r] = a
            self.b[slot, row:row + r, start:end] = b.t()
            row += r
        self.widths[slot] = row
        self.width = max(self.widths)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the projection of ``x``) with the step's adapters' updates added in place."""
        slots = self.context.slots
        if slots is None or not self.width:
            return y
        return lora_apply_(y, x, self.a, self.b, slots, self.width)
