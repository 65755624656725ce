"""Linear layer whose weight can be prepacked for oneDNN (bf16 on CPU).

``F.linear`` on bf16 CPU tensors re-lays-out the weight for oneDNN on every call; packing it
once (``torch.ops.mkldnn._reorder_linear_weight``) and calling ``_linear_pointwise`` makes the
small-batch (decode) matmuls about 2x faster. The packed tensor replaces the dense weight
(same element count and size), so memory is not doubled. Whether to pack is decided in
``conveyor.model.device.prepack_linear_weights``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PACK_BATCH_HINT = 64  # batch size oneDNN tunes the packed layout for


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features), requires_grad=False) if bias
                     else None)
        self.packed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def prepack(self) -> None:
        """Swap the dense weight for oneDNN's packed layout (inference only, after .to())."""
        if not self.packed:
            packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, PACK_BATCH_HINT)
            self.weight = nn.Parameter(packed, requires_grad=False)
            self.packed = True
