"""Weights kept as a GGUF file stores them (blocks of 32 along the input axis), for small batches.

* 4-bit, Q4_0 / Q4_1: ``w = d * q + m`` with ``q`` in 0..15 (Q4_0: ``m = -8 d``).
* 8-bit, Q8_0: ``w = d * q`` with ``q`` in -128..127. SmolLM2's file stores its token embedding
  this way; it is also the model's (tied) lm_head, the largest matrix of a decode step.

Why: at one to a few tokens a matmul is bound by reading its weights, and 4-bit codes are 3.6x
fewer bytes than bf16, 5x fewer than float32 (scales included); 8-bit ones 3.8x fewer than
float32. At larger batches oneDNN's GEMM wins, so ``Linear`` keeps both and picks per call (up
to ``max_tokens`` rows, the blocks).

The layouts, one per activation dtype, each where it is fast:

* ``PackedInt4`` (bf16): torch's ``_weight_int4pack_mm_for_cpu`` computes ``x @ W.T`` with
  ``W = (q - 8) * scale + zero`` per group of 32, so the file's blocks map on without loss:
  ``scale = d``, ``zero = m + 8 d`` (rounded to bf16).
* ``NibbleInt4`` and ``Int8Blocks`` (float32): the file's own byte order through
  ``kernels/block_matmul.cpp``; torch's int4 kernel is 13x slower with float32 activations than
  with bf16 (AVX2, torch 2.13). 8-bit blocks run with float32 activations only.

``Int8Blocks.rows`` also serves embedding lookups, so a model whose lm_head has its own packed
copy need not keep a dense embedding table too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.model.kernels.block_matmul import block_matmul

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
    # Rows up to which it serves the lm_head. SmolLM2's 49152 x 576 on AVX2: 0.86 ms against the
    # float32 panel GEMM's 2.33 at 1 row, 1.97 against 3.36 at 4, even at 8, behind from 12 on
    # (5.9 vs 4.4); engine steps of 6-16 decodes measured the same with a limit of 4 or 16.
    max_tokens = 16

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


def pack_blocks(blocks: Int4Blocks | Int8Blocks,
                dtype: torch.dtype) -> PackedInt4 | NibbleInt4 | Int8Blocks:
    """The layout that multiplies activations of ``dtype`` fastest."""
    k = blocks.codes.shape[1]
    if k % GROUP:
        raise ValueError(f"block weights need an input size divisible by {GROUP}, got {k}")
    if isinstance(blocks, Int8Blocks):
        if dtype != torch.float32:
            raise ValueError(f"8-bit weights run with float32 activations, not {dtype}")
        return blocks
    if dtype == torch.bfloat16:
        return PackedInt4.pack(blocks)
    if dtype == torch.float32:
        return NibbleInt4.pack(blocks)
    raise ValueError(f"4-bit weights run with bf16 or float32 activations, not {dtype}")


@dataclass
class PackedInt4:
    weight: torch.Tensor  # torch's packed int4 layout
    scales_and_zeros: torch.Tensor  # [K / 32, N, 2] bf16
    max_tokens = 4  # rows up to which it beats the bf16 GEMM (2x at 1 row, even at 8)

    @staticmethod
    def pack(blocks: Int4Blocks) -> PackedInt4:
        weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(blocks.codes.to(torch.int32), 2)
        zero = blocks.min + 8 * blocks.scale
        scales_and_zeros = torch.stack([blocks.scale.t(), zero.t()], dim=-1)
        scales_and_zeros = scales_and_zeros.to(torch.bfloat16).contiguous()
        return PackedInt4(weight, scales_and_zeros)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight, GROUP,
                                                          self.scales_and_zeros)

    def nbytes(self) -> int:
        return (self.weight.numel() * self.weight.element_size()
                + self.scales_and_zeros.numel() * self.scales_and_zeros.element_size())


@dataclass
class NibbleInt4:
    codes: torch.Tensor  # [N, K / 2] uint8: per block, byte j = q[j] | q[j + 16] << 4
    scale: torch.Tensor  # [N, K / 32] float32
    min: torch.Tensor  # [N, K / 32] float32
    # Rows up to which it serves the layers (and so the one-call decode path). SmolLM2-135M's
    # 30 layers on AVX2, matmuls alone: 5.0 ms against the float32 panel GEMM's 11.7 at 1 row,
    # 10.6 against 15.5 at 4, behind from 6 on (16.2 vs 13.3; 29.5 vs 19.5 at 12). Whole engine
    # steps, where this path also saves the per-layer Python: 22.8-23.5 ms against 28.6-30.5 at
    # 6 decodes, 27-28 against 34 at 8, about even at 10-12 (36-40 ms either way).
    max_tokens = 12

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
