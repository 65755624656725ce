"""Structured-output masks on a batch of logits.

A mask is xgrammar's packed token bitmask: one row of ``ceil(vocab / 32)`` int32 words per
constrained sequence, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed. Read as
bytes (little-endian), byte ``t // 8`` holds token ``t`` at bit ``t % 8``, so one table lookup
per byte (``embedding`` of a ``[256, 8]`` table of 0 / -inf) unpacks a row into an additive bias,
and one in-place add (or ``index_add_`` when only some rows are constrained) applies it: a few
passes over memory for the whole batch, on any device and dtype, unconstrained rows untouched.
Adding 0 leaves an allowed logit bit-identical.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_BIAS_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _bias_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 8]: for each byte value, 0 where its bit is set, else -inf."""
    table = _BIAS_TABLES.get((dtype, device))
    if table is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        table = torch.where(bits.bool(), 0.0, float("-inf")).to(dtype=dtype, device=device)
        _BIAS_TABLES[(dtype, device)] = table
    return table


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        mask_rows: list[int]) -> list[int]:
    """In place: ``logits[i]`` keeps only the tokens ``bitmask[mask_rows[i]]`` allows (others
    become -inf), for every row i with ``mask_rows[i] >= 0``. Returns the constrained rows."""
    rows = [i for i, m in enumerate(mask_rows) if m >= 0]
    if not rows:
        return rows
    device, vocab = logits.device, logits.shape[1]
    packed = bitmask[torch.tensor([mask_rows[i] for i in rows])].to(device, non_blocking=True)
    as_bytes = packed.view(torch.uint8).to(torch.int32)  # [k, 4 * words]
    bias = F.embedding(as_bytes, _bias_table(logits.dtype, device)).view(len(rows), -1)[:, :vocab]
    if len(rows) == logits.shape[0]:
        logits.add_(bias)
    else:
        logits.index_add_(0, torch.tensor(rows, device=device), bias)
    return rows
