"""The formats of a weight a GGUF file stores as blocks (``layers/quantized.py``,
``layers/gguf_blocks.py``):

* ``BlockMethod``: the file's blocks, multiplied as stored, serve calls of up to their
  ``max_tokens`` rows, where reading the weight dominates and the blocks are fewer bytes; another
  format (a dense one) serves the larger calls. The row-count switch
  lives here, and only here. A weight of one 4-bit or 8-bit type (Q4_0, Q4_1, Q8_0) takes
  ``pack_blocks``' layouts; the other types (Q5_0, Q5_1, K-quants, and stacks that mix types)
  ``QuantPanels``. Both pack from the file's bytes (``GGUFBlocks``).
* ``Int8BlockMethod``: integer compute (``weight_compute="int8"``): the file's blocks, every type
  and every number of rows, multiplied as integers against activations rounded to 8 bits per
  row and block of 32 (``kernels/int8_blocks.cpp``): the same bits whatever the batch, the
  thread count or the build target.
"""

from __future__ import annotations

import torch

from conveyor.model.kernels.decode_layer import DecodeProjection
from conveyor.model.kernels.int8_blocks import int8_block_gemm, int8_panel_lanes
from conveyor.model.layers.gguf_blocks import GGUFBlocks, GGUFPart, QuantPanels, int_blocks
from conveyor.model.layers.linear import LinearMethod, PanelMethod
from conveyor.model.layers.quantized import (
    BlockPanels,
    Blocks,
    NibbleInt4,
    pack_blocks,
)


class Int8BlockMethod(LinearMethod):
    """A weight's GGUF blocks (``GGUFBlocks``, one part per run of rows of one type), each part's
    bytes by panels (``GGUFPart.lane_panels``), every call on ``int8_block_gemm``; ``dtype``:
    the activations' (float32 or bf16, what ``dense_weight`` gives)."""

    def __init__(self, blocks: GGUFBlocks, dtype: torch.dtype) -> None:
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"int8 blocks run with float32 or bf16 activations, not {dtype}")
        self.dtype, self.lanes = dtype, int8_panel_lanes()
        self.out_features = blocks.out_features
        self.formats = [p.kind for p in blocks.parts]
        self.data = [p.lane_panels(self.lanes) for p in blocks.parts]
        self.sizes = [p.data.shape[0] for p in blocks.parts]

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = int8_block_gemm(x, self.formats, self.data, self.sizes)
        return y if bias is None else y.add_(bias)

    def dense_weight(self) -> torch.Tensor:
        parts = [GGUFPart.from_lane_panels(kind, data, rows, self.lanes)
                 for kind, data, rows in zip(self.formats, self.data, self.sizes, strict=True)]
        return GGUFBlocks(parts).dequantize().to(self.dtype)

    def nbytes(self) -> int:
        return sum(d.numel() for d in self.data)

    def decode_projection(self) -> DecodeProjection:
        return DecodeProjection(self, False, integer=True)


class BlockMethod(LinearMethod):
    """The file's blocks (``pack_blocks``' layout for the activations' dtype) up to
    ``max_tokens`` rows, ``large`` above them."""

    def __init__(self, small: NibbleInt4 | BlockPanels | Blocks | QuantPanels,
                 large: LinearMethod) -> None:
        self.small, self.large = small, large
        self.max_tokens = small.max_tokens
        self.out_features, self.dtype = large.out_features, large.dtype

    @staticmethod
    def pack(blocks: GGUFBlocks, large: LinearMethod, deterministic: bool = False) -> BlockMethod:
        """``deterministic``: small batches get the large ones' bits (``pack_blocks``,
        ``QuantPanels.pack``)."""
        codes = int_blocks(blocks)
        if codes is None:
            return BlockMethod(QuantPanels.pack(blocks, large.dtype, deterministic), large)
        return BlockMethod(pack_blocks(codes, large.dtype, deterministic), large)

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] <= self.max_tokens:
            y = self.small.matmul(x)
            return y if bias is None else y + bias
        return self.large.apply(x, bias)

    def dense_weight(self) -> torch.Tensor:
        return self.large.dense_weight()

    def nbytes(self) -> int:
        return self.small.nbytes() + self.large.nbytes()

    def bytes_read(self, rows: int) -> int:
        return self.small.nbytes() if rows <= self.max_tokens else self.large.bytes_read(rows)

    def decode_projection(self) -> DecodeProjection | None:
        """4-bit blocks or ``QuantPanels`` only; above them the panels, where the large format
        is those."""
        small, large = self.small, self.large
        if not (isinstance(small, (NibbleInt4, QuantPanels))
                or (isinstance(small, BlockPanels) and small.min is not None)):
            return None
        return DecodeProjection(
            small, isinstance(small, BlockPanels),
            panels=large.panels if isinstance(large, PanelMethod) else None)
