"""4-bit weights kept as a GGUF file stores them (Q4_0 / Q4_1 blocks of 32), for small batches.

A Q4_1 block of 32 weights is ``w = d * q + m`` with ``q`` in 0..15 (Q4_0: ``m = -8 d``).
torch's CPU kernel ``_weight_int4pack_mm_for_cpu`` computes ``x @ W.T`` with
``W = (q - 8) * scale + zero`` per group of 32 along the input axis, so the file's blocks map on
without loss: ``scale = d``, ``zero = m + 8 d`` (rounded to the activation dtype).

Why: at one to a few tokens a matmul is bound by reading its weights, and 4-bit codes are 3.6x
fewer bytes than bf16 (scales included). At larger batches oneDNN's bf16 GEMM wins, so
``Linear`` keeps both and picks per call (see ``INT4_MAX_TOKENS`` in ``linear.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
class PackedInt4:
    weight: torch.Tensor  # torch's packed int4 layout
    scales_and_zeros: torch.Tensor  # [K / 32, N, 2] in the activation dtype

    @staticmethod
    def pack(blocks: Int4Blocks, dtype: torch.dtype) -> PackedInt4:
        n, k = blocks.codes.shape
        if k % GROUP:
            raise ValueError(f"int4 weights need an input size divisible by {GROUP}, got {k}")
        weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(blocks.codes.to(torch.int32), 2)
        zero = blocks.min + 8 * blocks.scale
        scales_and_zeros = torch.stack([blocks.scale.t(), zero.t()], dim=-1).to(dtype).contiguous()
        return PackedInt4(weight, scales_and_zeros)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight, GROUP,
                                                          self.scales_and_zeros)

    def nbytes(self) -> int:
        return (self.weight.numel() * self.weight.element_size()
                + self.scales_and_zeros.numel() * self.scales_and_zeros.element_size())
