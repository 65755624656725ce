"""Integer matmul against a GGUF file's 4-bit or 8-bit weights on the CPU (``int8_gemm.cpp``
via ctypes, AVX512-VNNI), activations rounded to 8 bits per block of 32.

``int8_gemm_available()`` builds the kernel on first use (see ``build.py``) and says whether it
runs here (the compiler must target AVX512-VNNI and AVX512-BF16); ``CONVEYOR_KERNELS=off``
turns it off.
The weight layout is ``layers/quantized.py``'s ``Int8Panels``.
"""

from __future__ import annotations

import ctypes

import torch

from conveyor.model.kernels.build import kernel_function, kernel_library

_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P] * 7 + [_I] * 5 + [ctypes.c_int]
_SYMBOLS = {torch.float32: "int8_gemm_f32", torch.bfloat16: "int8_gemm_bf16"}
PANEL = 32  # outputs per panel
_BLOCK = 32  # inputs per scale block (layers/quantized.py: GROUP)


def _kernel(dtype: torch.dtype):
    lib = kernel_library("int8_gemm.cpp")
    if dtype not in _SYMBOLS or lib is None or not hasattr(lib, _SYMBOLS[dtype]):
        return None
    return kernel_function("int8_gemm.cpp", _SYMBOLS[dtype], _ARGTYPES)


def int8_gemm_available() -> bool:
    return _kernel(torch.bfloat16) is not None


def int8_gemm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
              n: int, exact: torch.Tensor | None = None,
              exact_weights: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, n] in x's dtype (float32 or bf16), W as ``Int8Panels`` holds it:
    ``codes`` [panels, K / 32, 8, 32, 4] uint8, ``scale`` and ``minimum`` [panels, K / 32, 32]
    float32; ``exact`` [E] int32 (E even) channels kept out of the rounding, their columns
    ``exact_weights`` [panels, E / 2, 32, 2] bf16."""
    kernel = _kernel(x.dtype)
    if kernel is None:
        raise RuntimeError(f"the int8 GEMM kernel for {x.dtype} is not available")
    panels, blocks = codes.shape[:2]
    k = blocks * _BLOCK
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    if panels * PANEL < n:
        raise ValueError(f"{panels} panels cannot hold {n} outputs")
    n_exact = 0 if exact is None else exact.shape[0]
    if n_exact and (exact.dtype != torch.int32 or n_exact % 2 or exact_weights is None
                    or exact_weights.shape != (panels, n_exact // 2, PANEL, 2)
                    or exact_weights.dtype != torch.bfloat16
                    or int(exact.min()) < 0 or int(exact.max()) >= k):
        raise ValueError(f"exact must be an even number of int32 channels below {k}, with "
                         f"bf16 exact_weights [{panels}, E / 2, {PANEL}, 2]")
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=x.dtype)
    kernel(y.data_ptr(), x.data_ptr(), codes.data_ptr(), scale.data_ptr(), minimum.data_ptr(),
           exact.data_ptr() if n_exact else None,
           exact_weights.data_ptr() if n_exact else None, n_exact,
           x.shape[0], n, k, x.stride(0), torch.get_num_threads())
    return y
