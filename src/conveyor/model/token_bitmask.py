"""Structured-output masks on a batch of logits: xgrammar's packed token bitmasks, applied to
the constrained rows in one indexed write (unconstrained rows are not touched)."""

from __future__ import annotations

import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 [R, W] packed (bit ``t % 32`` of word ``t // 32``) -> bool [R, vocab] allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        mask_rows: list[int]) -> list[int]:
    """In place: ``logits[i]`` keeps only the tokens ``bitmask[mask_rows[i]]`` allows (others
    become -inf), for every row i with ``mask_rows[i] >= 0``. Returns the constrained rows."""
    rows = [i for i, m in enumerate(mask_rows) if m >= 0]
    if not rows:
        return rows
    device = logits.device
    index = torch.tensor(rows, device=device)
    packed = bitmask[torch.tensor([mask_rows[i] for i in rows])].to(device, non_blocking=True)
    allowed = unpack_bitmask(packed, logits.shape[1])
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return rows
