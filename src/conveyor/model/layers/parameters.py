"""The parameters a checkpoint loads into (``model/loader.py``'s one pass): made empty, filled
one checkpoint tensor at a time."""

from __future__ import annotations

import torch
from torch import nn


def new_parameter(*shape: int, zero: bool = False) -> nn.Parameter:
    """``zero``: where parts of it may come from no tensor (a bias some shards lack)."""
    return nn.Parameter(torch.zeros(*shape) if zero else torch.empty(*shape), requires_grad=False)


def load_rows(param: nn.Parameter, start: int, stop: int, tensor: torch.Tensor) -> None:
    """Rows [start, stop) of ``param`` from a checkpoint tensor; when those are all of it, the
    parameter takes the tensor itself (in its dtype): no copy, no second touch of the memory."""
    rows = param.data[start:stop]
    if rows.shape != tensor.shape:
        raise ValueError(f"got shape {tuple(tensor.shape)}, expected {tuple(rows.shape)}")
    if rows.shape == param.shape:
        param.data = tensor.to(param.dtype).contiguous()
    else:
        rows.copy_(tensor)
