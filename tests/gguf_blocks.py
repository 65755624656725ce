"""Helpers shared by tests (``tests/`` is on pytest's python path): random quantized blocks as
a GGUF file holds them (``file_blocks``, ``raw_blocks``), loaded into a ``Linear`` as a GGUF
checkpoint loads them."""

from __future__ import annotations

import torch

from conveyor.model.layers.gguf_blocks import LAYOUTS, Q6_K, GGUFBlocks
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


def near_q4_0_blocks(n: int, k: int, gen: torch.Generator) -> Int4Blocks:
    """[n, k] 4-bit blocks whose minima sit near -8 times their scales (a Q4_0-like layer with
    small offsets), fp16 values widened to float32."""
    scale = (torch.rand(n, k // GROUP, generator=gen) * 0.02 + 0.005).half().float()
    low = -8 * scale + 0.01 * torch.randn(n, k // GROUP, generator=gen)
    return Int4Blocks(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen), scale,
                      low.half().float())


def load_blocks(linear: Linear, blocks: Int4Blocks | Int8Blocks) -> None:
    """All of ``linear``'s rows as a GGUF file's blocks (``GGUFBlocks.of``), shard by shard."""
    for name, (start, stop) in linear.shards.items():
        rows = {f: getattr(blocks, f)[start:stop] for f in ("codes", "scale", "min")
                if hasattr(blocks, f)}
        linear.load("weight", name, None, GGUFBlocks.of(type(blocks)(**rows)))


def raw_blocks(kind: int, n: int, k: int, gen: torch.Generator) -> GGUFBlocks:
    """[n, k] random bytes of GGUF type ``kind`` (``layers/gguf_blocks.py``'s ``LAYOUTS``) as a
    file holds them: random codes and scale bytes, small finite fp16 scales and minima."""
    layout = LAYOUTS[kind]
    blocks = torch.randint(0, 256, (n, k // layout.block, layout.block_bytes), generator=gen,
                           dtype=torch.uint8)
    d_at = [layout.header[1] - 2] if kind == Q6_K else [0, 2] if layout.header[1] >= 4 else [0]
    for at in d_at:
        half = ((torch.rand(n, k // layout.block, generator=gen) - 0.5) * 0.02).half()
        blocks[..., at:at + 2] = half.view(torch.uint8).view(n, -1, 2)
    return GGUFBlocks.from_file(kind, blocks.view(n, -1))
