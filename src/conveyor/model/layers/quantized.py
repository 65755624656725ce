"""Weights kept as a GGUF file stores them (blocks of 32 along the input axis), for small batches.

* 4-bit, Q4_0 / Q4_1: ``w = d * q + m`` with ``q`` in 0..15 (Q4_0: ``m = -8 d``).
* 8-bit, Q8_0: ``w = d * q`` with ``q`` in -128..127. SmolLM2's file stores its token embedding
  this way; it is also the model's (tied) lm_head, the largest matrix of a decode step.

Why: at one to a few tokens a matmul is bound by reading its weights, and 4-bit codes are 2.7x
fewer bytes than bf16, 5.3x fewer than float32 (float32 scales and minima included); 8-bit ones
1.8x and 3.6x fewer. At larger batches the dense GEMM wins, so ``layers/block_method.py``'s
``BlockMethod`` keeps both and picks per call (up to ``max_tokens`` rows, the blocks).

Both run in the file's own byte order through ``kernels/block_matmul.cpp``, with float32 or bf16
activations, so their weights are exactly the file's (``d``, ``m`` held as float32).
``max_tokens`` depends on the activation dtype, as the dense GEMM it is weighed against does:
bf16 panels on AVX512-BF16 overtake the blocks at fewer rows than float32 panels do
(docs/performance.md has the measurements).

``Int8Blocks.rows`` also serves embedding lookups, so a model whose lm_head has its own packed
copy need not keep a dense embedding table too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from conveyor.model.kernels.block_matmul import block_matmul
from conveyor.model.kernels.panel_gemm import (
    block_panel_gemm,
    block_panel_gemm_available,
    panel_width,
)

GROUP = 32


@dataclass
class Int4Blocks:
    """A [N, K] weight as 4-bit codes with one scale and one minimum per 32 inputs."""
    codes: torch.Tensor  # [N, K] uint8, 0..15
    scale: torch.Tensor  # [N, K / 32] float32
    min: torch.Tensor  # [N, K / 32] float32

    @staticmethod
    def cat(parts: list[Int4Blocks]) -> Int4Blocks:
        """Stack along the output axis (fused QKV and gate/up projections)."""
        return Int4Blocks(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.min for p in parts]))

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        w = self.codes.view(n, k // GROUP, GROUP).float() * self.scale[..., None] + self.min[..., None]
        return w.view(n, k)


@dataclass
class Int8Blocks:
    """A [N, K] weight as 8-bit codes with one scale per 32 inputs; runs as it is stored."""
    codes: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N, K / 32] float32
    # Rows up to which it serves the lm_head: below it, reading the 8-bit blocks beats the
    # panel GEMM's reading twice (bf16) or four times (float32) the bytes; above it the GEMM's
    # arithmetic wins. bf16 panels catch up sooner (pack_blocks sets BF16_MAX_TOKENS);
    # docs/performance.md has the measurements.
    max_tokens: int = 16

    @staticmethod
    def cat(parts: list[Int8Blocks]) -> Int8Blocks:
        return Int8Blocks(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]))

    def dequantize(self) -> torch.Tensor:
        return self.rows(torch.arange(self.codes.shape[0]), torch.float32)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized rows ``ids`` (an embedding lookup): [len(ids), K] in ``dtype``."""
        codes, scale = self.codes[ids], self.scale[ids]
        n, k = codes.shape
        w = codes.view(n, k // GROUP, GROUP).float() * scale[..., None]
        return w.view(n, k).to(dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return block_matmul(x, self.codes, self.scale)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale))


Blocks = Int4Blocks | Int8Blocks  # a weight as a GGUF file stores it


def _check_input_size(k: int) -> None:
    if k % GROUP:
        raise ValueError(f"block weights need an input size divisible by {GROUP}, got {k}")


# Rows up to which blocks serve a bf16 model's calls, 4- and 8-bit alike (see max_tokens).
BF16_MAX_TOKENS = 4


def pack_blocks(blocks: Blocks, dtype: torch.dtype,
                deterministic: bool = False) -> NibbleInt4 | Int8Blocks | BlockPanels:
    """The blocks laid out for ``block_matmul`` with activations of ``dtype``. ``deterministic``:
    as ``BlockPanels``, whose products equal the dense panels' bit for bit; where those cannot
    run, blocks that serve no rows (``max_tokens`` 0), so that the dense weight serves every
    batch size (the blocks' weights, exact float32, and order of sums differ from the panels')."""
    _check_input_size(blocks.codes.shape[1])
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"block weights run with float32 or bf16 activations, not {dtype}")
    if deterministic and BlockPanels.fits(blocks, dtype):
        return BlockPanels.pack(blocks, dtype)
    packed = NibbleInt4.pack(blocks) if isinstance(blocks, Int4Blocks) else replace(blocks)
    if deterministic:
        packed.max_tokens = 0
    elif dtype == torch.bfloat16:
        packed.max_tokens = BF16_MAX_TOKENS
    return packed


@dataclass
class BlockPanels:
    """4-bit or 8-bit blocks in column panels (``panel_width()`` outputs: 32 with AVX-512, 16 with
    AVX2) for ``block_panel_gemm`` (``kernels/panel_gemm.cpp``): each output computed as the panel
    GEMM computes it over the dense weight (the file's float32 dequantization, rounded to bf16 for
    bf16 activations), so small batches read the file's bytes and still give the large ones' bits.
    Per panel and block of 32 inputs, the codes of each step of K in the order of the panel's
    vectors (see the kernel); ``scale`` and ``min`` hold that block's outputs' values side by
    side."""
    codes: torch.Tensor  # [N, K / 2] uint8 (4-bit) or [N, K] int8 (8-bit), in panel order
    scale: torch.Tensor  # [N, K / 32] float32, in panel order
    min: torch.Tensor | None  # as scale; None for 8-bit
    # Rows up to which it serves, as the blocks it replaces.
    max_tokens: int = 12

    @staticmethod
    def fits(blocks: Blocks, dtype: torch.dtype) -> bool:
        return block_panel_gemm_available(dtype) and blocks.codes.shape[0] % panel_width() == 0

    @staticmethod
    def pack(blocks: Blocks, dtype: torch.dtype,
             width: int | None = None) -> BlockPanels:
        """``width``: outputs per panel, the native build's ``panel_width()`` unless given."""
        n, k = blocks.codes.shape
        width = width or panel_width()
        panels, steps = n // width, k // GROUP
        if n % width:
            raise ValueError(f"block panels need outputs in multiples of {width}, got {n}")
        codes = blocks.codes.view(panels, width, steps, GROUP)
        if dtype == torch.bfloat16:  # a step: pairs of k, word 2j + e = output j, k = 2i + e
            words = codes.view(panels, width, steps, GROUP // 2, 2).permute(0, 2, 3, 1, 4)
            words = words.reshape(panels, steps, GROUP // 2, 2 * width)
        else:  # a step: one k, output j
            words = codes.permute(0, 2, 3, 1)
        if isinstance(blocks, Int4Blocks):
            half = words.shape[-1] // 2
            words = words[..., :half] | (words[..., half:] << 4)

        def per_panel(t: torch.Tensor) -> torch.Tensor:
            return t.float().view(panels, width, steps).transpose(1, 2).reshape(n, steps)

        packed = BlockPanels(words.reshape(n, -1).contiguous(), per_panel(blocks.scale),
                             per_panel(blocks.min) if isinstance(blocks, Int4Blocks) else None)
        if dtype == torch.bfloat16:
            packed.max_tokens = BF16_MAX_TOKENS
        return packed

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return block_panel_gemm(x, self.codes, self.scale, self.min)

    def nbytes(self) -> int:
        parts = [self.codes, self.scale] + ([] if self.min is None else [self.min])
        return sum(t.numel() * t.element_size() for t in parts)


@dataclass
class NibbleInt4:
    codes: torch.Tensor  # [N, K / 2] uint8: per block, byte j = q[j] | q[j + 16] << 4
    scale: torch.Tensor  # [N, K / 32] float32
    min: torch.Tensor  # [N, K / 32] float32
    # Rows up to which it serves the layers (and so the one-call decode path): where reading
    # the weight dominates a matmul, fewer bytes win, and whole decode steps gain more than
    # the matmuls alone as this path also saves the per-layer Python. bf16 panels catch up
    # sooner (BF16_MAX_TOKENS); docs/performance.md has the measurements.
    max_tokens: int = 12

    @staticmethod
    def pack(blocks: Int4Blocks) -> NibbleInt4:
        n, k = blocks.codes.shape
        halves = blocks.codes.view(n, k // GROUP, 2, GROUP // 2)
        codes = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
        return NibbleInt4(codes, blocks.scale.float().contiguous(), blocks.min.float().contiguous())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return block_matmul(x, self.codes, self.scale, self.min)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.min))
