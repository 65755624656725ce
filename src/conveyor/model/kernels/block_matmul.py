"""Block-quantized matmul for float32 or bf16 activations on the CPU (``block_matmul.cpp`` via
ctypes): 4-bit (GGUF Q4_0 / Q4_1) and 8-bit (Q8_0) weights.

``block_matmul_available()`` builds the kernel on first use (see ``build.py``) and says whether
it can run here; ``CONVEYOR_KERNELS=off`` turns it off.
"""

from __future__ import annotations

import ctypes

import torch

from conveyor.model.kernels.build import kernel_function

_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_ARGTYPES = [_P] * 5 + [_I] * 4 + [_C, _C]


_SYMBOLS = {torch.float32: "block_matmul_f32", torch.bfloat16: "block_matmul_bf16"}


def _kernel(dtype: torch.dtype = torch.float32):
    return kernel_function("block_matmul.cpp", _SYMBOLS[dtype], _ARGTYPES)


def block_matmul_available() -> bool:
    return _kernel() is not None


def block_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                 minimum: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, N] in x's dtype (float32 or bf16, accumulated in float32), W given
    as blocks of 32 along K with ``scale`` [N, K / 32] float32 and either 4-bit ``codes``
    [N, K / 2] uint8 (GGUF nibble order) and a ``minimum`` [N, K / 32] (w = scale * code +
    minimum), or 8-bit ``codes`` [N, K] int8 and no minimum (w = scale * code)."""
    bits = 8 if minimum is None else 4
    n, k = codes.shape[0], codes.shape[1] * (8 // bits)
    if x.dtype not in _SYMBOLS or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be float32 or bf16 [M, {k}], got {x.dtype} {tuple(x.shape)}")
    kernel = _kernel(x.dtype)
    if kernel is None:
        raise RuntimeError("the block matmul kernel is not available")
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=x.dtype)
    kernel(y.data_ptr(), x.data_ptr(), codes.data_ptr(), scale.data_ptr(),
           0 if minimum is None else minimum.data_ptr(), x.shape[0], n, k, x.stride(0), bits,
           torch.get_num_threads())
    return y
