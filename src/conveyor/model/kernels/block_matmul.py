"""Block-quantized matmul for float32 or bf16 activations on the CPU
(``torch.ops.conveyor.block_matmul``, ``block_matmul.cpp``): 4-bit (GGUF Q4_0 / Q4_1) and 8-bit
(Q8_0) weights.

``block_matmul_available()`` builds the kernels on first use (see ``build.py``) and says whether
they can run here; ``CONVEYOR_KERNELS=off`` turns them off.
"""

from __future__ import annotations

import torch

from conveyor.model.kernels.build import kernel_ops


def block_matmul_available() -> bool:
    return kernel_ops() is not None


def block_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                 minimum: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, N] in x's dtype (float32 or bf16, accumulated in float32), W given
    as blocks of 32 along K with ``scale`` [N, K / 32] float32 and either 4-bit ``codes``
    [N, K / 2] uint8 (GGUF nibble order) and a ``minimum`` [N, K / 32] (w = scale * code +
    minimum), or 8-bit ``codes`` [N, K] int8 and no minimum (w = scale * code)."""
    ops = kernel_ops()
    if ops is None:
        raise RuntimeError("the block matmul kernel is not available")
    return ops.block_matmul(x, codes, scale, minimum)
