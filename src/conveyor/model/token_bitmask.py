"""Structured-output masks on a batch of logits: xgrammar's packed token bitmasks (bit ``t % 32``
of word ``t // 32`` set when token ``t`` is allowed), applied in place to the constrained rows by
xgrammar's kernel for the logits' device (C++ on the CPU, Triton/CUDA on a GPU) in one call;
unconstrained rows are not touched."""

from __future__ import annotations

import torch


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        mask_rows: list[int]) -> list[int]:
    """In place: ``logits[i]`` keeps only the tokens ``bitmask[mask_rows[i]]`` allows (others
    become -inf), for every row i with ``mask_rows[i] >= 0``. Returns the constrained rows."""
    rows = [i for i, m in enumerate(mask_rows) if m >= 0]
    if not rows:
        return rows
    import xgrammar as xgr

    # one bitmask row per logits row (an n > 1 fork repeats its row), on the logits' device
    aligned = bitmask[torch.tensor([max(m, 0) for m in mask_rows])].to(logits.device,
                                                                       non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, aligned, vocab_size=logits.shape[1],
                                    indices=rows if len(rows) < len(mask_rows) else None)
    return rows
