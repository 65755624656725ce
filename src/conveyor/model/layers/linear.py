"""Linear layer whose weight can be prepacked for oneDNN (CPU), with an optional quantized copy.

``F.linear`` on bf16 CPU tensors re-lays-out the weight for oneDNN on every call; packing it
once (``torch.ops.mkldnn._reorder_linear_weight``) and calling ``_linear_pointwise`` makes the
small-batch (decode) matmuls about 2x faster. In float32 (CPUs without native bf16) the packed
GEMM beats ``F.linear``'s MKL call too: 1.1x at 64 rows, 2.4x at 4 (AVX2). The packed tensor
replaces the dense weight (same element count and size), so memory is not doubled. Whether to
pack is decided in ``conveyor.model.device.prepack_linear_weights``.

When the checkpoint stored the weight as blocks (GGUF Q4_0 / Q4_1 / Q8_0), ``quantized`` holds
them too (``layers/quantized.py``) and serves calls of up to its ``max_tokens`` rows, where
reading the weight dominates. For 4-bit blocks over SmolLM2-135M's 30 layers on the AVX-512
machine: 4.4 ms against 14.7 ms for bf16 at 1 token, about even at 8, 89 against 19 ms at 64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.model.layers.quantized import Int8Blocks, NibbleInt4, PackedInt4

PACK_BATCH_HINT = 64  # batch size oneDNN tunes the packed layout for


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features), requires_grad=False) if bias
                     else None)
        self.packed = False
        self.quantized: PackedInt4 | NibbleInt4 | Int8Blocks | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None and x.shape[0] <= self.quantized.max_tokens:
            y = self.quantized.matmul(x)
            return y if self.bias is None else y + self.bias
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def weight_bytes(self, rows: int) -> int:
        """Bytes of weight a call with ``rows`` rows reads."""
        if self.quantized is not None and rows <= self.quantized.max_tokens:
            return self.quantized.nbytes()
        return self.weight.numel() * self.weight.element_size()

    def prepack(self) -> None:
        """Swap the dense weight for oneDNN's packed layout (inference only, after .to())."""
        if not self.packed:
            packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, PACK_BATCH_HINT)
            self.weight = nn.Parameter(packed, requires_grad=False)
            self.packed = True
