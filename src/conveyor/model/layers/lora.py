"""LoRA on the model's projections: each adapter's low-rank update added to a projection's
output for the rows (tokens) of the step that run under it.

``LoRAContext`` is shared by every projection of a model: the executor sets, per step, which
rows run under which adapter (``set_rows``); it lays them out once as a padded [groups, rows]
index, one group per adapter. ``LoRALayer`` stacks, per projection, every adapter's A
[slots, R, in] and B [slots, out, R]: the modules fused into one projection (q/k/v into
``qkv_proj``, gate/up into ``gate_up_proj``) take their own columns of R and rows of B (B is
block-diagonal over them), the scale is folded into B, and slot 0 is all zeros (an adapter that
leaves this projection alone). A step then costs each projection two batched matmuls over the
groups, however many adapters it mixes (the segmented "SGMV" shape of S-LoRA and Punica). They
run in float32: the weights are small, and on CPUs torch's float32 batched matmul is several
times faster than its bf16 one at these shapes. The stacks gathered for a step's adapters are
kept while the next steps run the same adapters (decode steps mostly do).
"""

from __future__ import annotations

import torch


class LoRAContext:
    def __init__(self) -> None:
        self.adapter_ids: list[int] = []  # one per group
        self.rows: torch.Tensor | None = None  # [groups, longest group], padded with row 0
        self.flat_rows: torch.Tensor | None = None  # the real rows, group after group
        self.valid: torch.Tensor | None = None  # their positions in rows.flatten()

    @property
    def active(self) -> bool:
        return bool(self.adapter_ids)

    def set_rows(self, groups: list[tuple[int, list[int]]], device: torch.device) -> None:
        """This step's (adapter id, its flat rows) groups; base rows left out."""
        self.adapter_ids = [lid for lid, _ in groups]
        if not groups:
            self.rows = self.flat_rows = self.valid = None
            return
        longest = max(len(rows) for _, rows in groups)
        padded, valid, flat = [], [], []
        for g, (_, rows) in enumerate(groups):
            padded.append(rows + [0] * (longest - len(rows)))
            valid.extend(range(g * longest, g * longest + len(rows)))
            flat.extend(rows)
        self.rows = torch.tensor(padded, device=device)
        self.valid = torch.tensor(valid, device=device)
        self.flat_rows = torch.tensor(flat, device=device)


class LoRALayer:
    def __init__(self, context: LoRAContext, slices: dict[str, tuple[int, int]],
                 in_features: int) -> None:
        """``slices``: each module fused into the projection -> its output columns."""
        self.context = context
        self.slices = slices
        self.in_features = in_features
        self.out_features = max(end for _, end in slices.values())
        # adapter id -> {module: (A [r, in], B [cols, r] * scale)}
        self.parts: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.slot_of: dict[int, int] = {}
        self.a: torch.Tensor | None = None  # [slots, in, R], float32
        self.b: torch.Tensor | None = None  # [slots, R, out], float32
        self._gathered: tuple[list[int], torch.Tensor, torch.Tensor] | None = None

    def set(self, adapter_id: int, parts: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """What ``adapter_id`` updates here: per module its A [r, in] and B [cols, r] * scale
        (none: it leaves this projection alone); replaces what it held."""
        if parts:
            self.parts[adapter_id] = {m: (a.float(), b.float()) for m, (a, b) in parts.items()}
        elif self.parts.pop(adapter_id, None) is None:
            return
        self._stack()

    def _stack(self) -> None:
        self._gathered = None
        ids = sorted(self.parts)
        if not ids:
            self.slot_of, self.a, self.b = {}, None, None
            return
        width = max(sum(a.shape[0] for a, _ in self.parts[i].values()) for i in ids)
        device = next(iter(self.parts[ids[0]].values()))[0].device
        a_stack = torch.zeros(len(ids) + 1, self.in_features, width, device=device)
        b_stack = torch.zeros(len(ids) + 1, width, self.out_features, device=device)
        for slot, adapter_id in enumerate(ids, start=1):
            col = 0
            for module, (a, b) in self.parts[adapter_id].items():
                start, end = self.slices[module]
                r = a.shape[0]
                a_stack[slot, :, col:col + r] = a.t()
                b_stack[slot, col:col + r, start:end] = b.t()
                col += r
        self.slot_of = {adapter_id: slot for slot, adapter_id in enumerate(ids, start=1)}
        self.a, self.b = a_stack, b_stack

    def _for_step(self, adapter_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The stacks of the step's adapters, group by group."""
        held = self._gathered
        if held is None or held[0] != adapter_ids:
            slots = torch.tensor([self.slot_of.get(i, 0) for i in adapter_ids],
                                 device=self.a.device)
            held = self._gathered = (list(adapter_ids), self.a[slots], self.b[slots])
        return held[1], held[2]

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the projection of ``x``) with the step's adapters' updates added in place."""
        ctx = self.context
        if not ctx.active or self.a is None:
            return y
        a, b = self._for_step(ctx.adapter_ids)  # [groups, in, R], [groups, R, out]
        t = torch.bmm(x[ctx.rows].float(), a)  # [groups, rows, R]
        update = torch.bmm(t, b).flatten(0, 1)[ctx.valid]
        return y.index_add_(0, ctx.flat_rows, update.to(y.dtype))
