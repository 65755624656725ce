"""4-bit block matmul for float32 activations on the CPU (``q4_matmul.cpp`` via ctypes).

``q4_matmul_available()`` builds the kernel on first use (see ``build.py``) and says whether it
can run here; ``CONVEYOR_KERNELS=off`` turns it off.
"""

from __future__ import annotations

import ctypes

import torch

from conveyor.model.kernels.build import kernel_library

_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P] * 5 + [_I] * 4 + [ctypes.c_int]


def _library() -> ctypes.CDLL | None:
    lib = kernel_library("q4_matmul.cpp")
    if lib is not None and lib.q4_matmul_f32.argtypes is None:
        lib.q4_matmul_f32.argtypes, lib.q4_matmul_f32.restype = _ARGTYPES, None
    return lib


def q4_matmul_available() -> bool:
    return _library() is not None


def q4_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
              minimum: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ W.T -> [M, N], W given as ``codes`` [N, K / 2] uint8 (GGUF nibble
    order), ``scale`` and ``minimum`` [N, K / 32] float32."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the 4-bit matmul kernel is not available")
    n, k = codes.shape[0], codes.shape[1] * 2
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be float32 [M, {k}], got {x.dtype} {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    lib.q4_matmul_f32(y.data_ptr(), x.data_ptr(), codes.data_ptr(), scale.data_ptr(),
                      minimum.data_ptr(), x.shape[0], n, k, x.stride(0), torch.get_num_threads())
    return y
