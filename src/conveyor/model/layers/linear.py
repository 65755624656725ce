"""Linear layer whose weight is laid out once for the CPU's fastest GEMM, with an optional
quantized copy.

``prepack`` picks the layout (``conveyor.model.device.linear_packing`` decides which):

* ``"panels"``: column panels for the C++ GEMM of ``kernels/panel_gemm.cpp``, float32, and bf16
  where the CPU has AVX512-BF16. On the 2-core AVX2 machine it beat oneDNN's packed float32 GEMM
  by 1.25-1.35x from 64 to 4,096 rows; in bf16 on a 2-core Zen 4, 1.1-1.3x at 64 rows
  (docs/performance.md, changes 19 and 28).
* ``"onednn"``, bf16 on CPUs with AMX (oneDNN's AMX GEMM is faster) or native bf16 without
  AVX512-BF16, and float32 without a C++ compiler: ``F.linear`` on bf16
  CPU tensors re-lays-out the weight for oneDNN on every call; packing it once
  (``torch.ops.mkldnn._reorder_linear_weight``) and calling ``_linear_pointwise`` makes the
  small-batch (decode) matmuls about 2x faster.

* ``"int8"``, set by ``use_int8_panels`` rather than ``prepack``: a bf16 model's GGUF 4-bit or
  8-bit blocks as ``Int8Panels`` (``kernels/int8_gemm.cpp``, AVX512-VNNI), activations rounded
  to 8 bits per block of 32. On a 2-core Zen 4, SmolLM2's projections ran 1.1-1.4x faster than
  on bf16 panels (docs/performance.md, change 32).

Any of these replaces the dense weight, so memory is not doubled; ``dense_weight()`` gives the
[out, in] matrix back.

When the checkpoint stored the weight as blocks (GGUF Q4_0 / Q4_1 / Q8_0), ``quantized`` holds
them too (``layers/quantized.py``) and serves calls of up to its ``max_tokens`` rows, where
reading the weight dominates. For 4-bit blocks over SmolLM2-135M's 30 layers on a 2-core Zen 4
with bf16 activations: 3.5 ms against the bf16 panels' 5.0-7.1 at 1 token, about even at 4,
14.0 against 8.7 ms at 8.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.model.kernels.panel_gemm import pack_panels, panel_gemm, unpack_panels
from conveyor.model.layers.quantized import Int4Blocks, Int8Blocks, Int8Panels, NibbleInt4

PACK_BATCH_HINT = 64  # batch size oneDNN tunes the packed layout for


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features), requires_grad=False) if bias
                     else None)
        self.out_features = out_features
        self.packing: str | None = None  # None (dense), "panels", "onednn" or "int8"
        self.quantized: NibbleInt4 | Int8Blocks | None = None
        self.int8: Int8Panels | None = None  # packing "int8": see use_int8_panels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None and x.shape[0] <= self.quantized.max_tokens:
            y = self.quantized.matmul(x)
            return y if self.bias is None else y + self.bias
        if self.packing == "panels":
            y = panel_gemm(x, self.weight, self.out_features)
            return y if self.bias is None else y.add_(self.bias)
        if self.packing == "int8":
            y = self.int8.matmul(x)
            return y if self.bias is None else y.add_(self.bias)
        if self.packing == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def weight_bytes(self, rows: int) -> int:
        """Bytes of weight a call with ``rows`` rows reads."""
        if self.quantized is not None and rows <= self.quantized.max_tokens:
            return self.quantized.nbytes()
        if self.packing == "int8":
            return self.int8.nbytes()
        return self.weight.numel() * self.weight.element_size()

    def dense_weight(self) -> torch.Tensor:
        """The weight as an [out, in] matrix, whatever its layout."""
        if self.packing == "panels":
            return unpack_panels(self.weight, self.out_features)
        if self.packing == "onednn":
            return self.weight.to_dense()
        if self.packing == "int8":
            return self.int8.dequantize().to(self.weight.dtype)
        return self.weight

    def prepack(self, packing: str) -> None:
        """Swap the dense weight for ``packing``'s layout, "panels" or "onednn" (inference only,
        after .to())."""
        if self.packing is not None:
            return
        if packing == "panels":
            packed = pack_panels(self.weight.data)
        elif packing == "onednn":
            packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, PACK_BATCH_HINT)
        else:
            raise ValueError(f"packing must be 'panels' or 'onednn', got {packing!r}")
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.packing = packing

    def use_int8_panels(self, blocks: Int4Blocks | Int8Blocks,
                        exact: torch.Tensor | None = None) -> int:
        """Serve calls above the blocks' rows from ``Int8Panels`` of the checkpoint's ``blocks``
        (``exact``: input channels kept out of the rounding) instead of the (packed) dense
        weight, which is dropped. Returns the bytes added."""
        if blocks.codes.shape[0] != self.out_features:
            raise ValueError(f"blocks of {blocks.codes.shape[0]} outputs for a "
                             f"{self.out_features}-output layer")
        self.int8 = Int8Panels.pack(blocks, exact)
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)
        self.packing = "int8"
        return self.int8.nbytes()
