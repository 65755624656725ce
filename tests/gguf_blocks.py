"""Helpers shared by tests (``tests/`` is on pytest's python path): random quantized blocks as
a GGUF file holds them, loaded into a ``Linear`` as a GGUF checkpoint loads them."""

from __future__ import annotations

import torch

from conveyor.model.layers.linear import Linear
from conveyor.model.layers.quantized import GROUP, Int4Blocks, Int8Blocks


def file_blocks(bits: int, n: int, k: int, gen: torch.Generator) -> Int4Blocks | Int8Blocks:
    """[n, k] blocks of ``bits`` (4 or 8) with fp16 scales and minima widened to float32, so that
    ``q * d`` is exact in float32, as it is for a real file."""
    scale = (torch.rand(n, k // GROUP, generator=gen) * 0.02 + 1e-4).half().float()
    if bits == 8:
        return Int8Blocks(torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8), scale)
    low = (-torch.rand(n, k // GROUP, generator=gen) * 0.2).half().float()
    return Int4Blocks(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8), scale, low)


def load_blocks(linear: Linear, blocks: Int4Blocks | Int8Blocks) -> None:
    """All of ``linear``'s rows: ``blocks`` and their float32 dequantization, shard by shard."""
    dense = blocks.dequantize()
    for name, (start, stop) in linear.shards.items():
        rows = {f: getattr(blocks, f)[start:stop] for f in ("codes", "scale", "min")
                if hasattr(blocks, f)}
        linear.load("weight", name, dense[start:stop], type(blocks)(**rows))
