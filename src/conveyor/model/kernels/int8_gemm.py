"""Integer matmul against a GGUF file's 4-bit or 8-bit weights on the CPU
(``torch.ops.conveyor.int8_gemm``, ``int8_gemm.cpp``, AVX512-VNNI), activations rounded to 8
bits per block of 32.

``int8_gemm_available()`` builds the kernels on first use (see ``build.py``) and says whether
this one runs here (the build must target AVX512-VNNI and AVX512-BF16);
``CONVEYOR_KERNELS=off`` turns them off. The weight layout is ``layers/quantized.py``'s
``Int8Panels``.
"""

from __future__ import annotations

import torch

from conveyor.model.kernels.build import kernel_features, kernel_ops

PANEL = 32  # outputs per panel


def int8_gemm_available() -> bool:
    return "int8_gemm" in kernel_features()


def int8_gemm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
              n: int, exact: torch.Tensor | None = None,
              exact_weights: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, n] in x's dtype (float32 or bf16), W as ``Int8Panels`` holds it:
    ``codes`` [panels, K / 32, 8, 32, 4] uint8, ``scale`` and ``minimum`` [panels, K / 32, 32]
    float32; ``exact`` [E] int32 (E even) channels kept out of the rounding, their columns
    ``exact_weights`` [panels, E / 2, 32, 2] bf16."""
    if not int8_gemm_available():
        raise RuntimeError(f"the int8 GEMM kernel for {x.dtype} is not available")
    return kernel_ops().int8_gemm(x, codes, scale, minimum, n, exact, exact_weights)
